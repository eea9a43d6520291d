import subprocess
import sys

import pytest

from transformer.machine.allocator import MALLOC_CONF, OPT_OUT, allocator_hint, jemalloc_environment, jemalloc_library

LIB = "/usr/lib/libjemalloc.so.2"


def test_restart_environment_preloads_jemalloc_before_the_users_preloads():
    env = jemalloc_environment({"LD_PRELOAD": "/opt/libother.so", "PATH": "/bin"}, LIB, loaded=False)
    assert env["LD_PRELOAD"] == f"{LIB} /opt/libother.so"
    assert env["MALLOC_CONF"] == MALLOC_CONF and env["PATH"] == "/bin"
    assert env[OPT_OUT] == "jemalloc"  # the restarted process does not restart again


def test_restart_environment_keeps_the_users_malloc_conf():
    assert jemalloc_environment({"MALLOC_CONF": "narenas:1"}, LIB, loaded=False)["MALLOC_CONF"] == "narenas:1"


@pytest.mark.parametrize(
    "env, library, loaded",
    [({OPT_OUT: "system"}, LIB, False), ({}, LIB, True), ({}, None, False)],
    ids=["opted out", "already loaded", "none installed"],
)
def test_no_restart(env, library, loaded):
    assert jemalloc_environment(env, library, loaded) is None


def test_hint_only_for_cpu_runs_that_did_not_opt_out(monkeypatch):
    monkeypatch.setattr("transformer.machine.allocator.jemalloc_loaded", lambda: False)
    monkeypatch.delenv(OPT_OUT, raising=False)
    assert "jemalloc" in allocator_hint("cpu") and allocator_hint("cuda") is None
    monkeypatch.setenv(OPT_OUT, "system")
    assert allocator_hint("cpu") is None


@pytest.mark.skipif(not sys.platform.startswith("linux") or jemalloc_library() is None, reason="no jemalloc here")
@pytest.mark.parametrize("choice, loaded", [(None, True), ("system", False)])
def test_a_command_restarts_itself_under_jemalloc(monkeypatch, choice, loaded):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv(OPT_OUT, raising=False)
    if choice:
        monkeypatch.setenv(OPT_OUT, choice)
    code = "import sys; from transformer.machine import allocator as a; a.restart_with_jemalloc(); print(a.jemalloc_loaded(), sys.argv[1:])"
    out = subprocess.run([sys.executable, "-c", code, "arg"], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(loaded), "['arg']"]  # the same command, its arguments kept
