import subprocess
import sys
from types import SimpleNamespace

import hydra
import pytest

from transformer.cli.command import check_overrides
from transformer.machine.allocator import MALLOC_CONF, OPT_OUT, allocator_hint, jemalloc_environment, jemalloc_library
from transformer.training.memory import ReleaseFreedMemory

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


@pytest.mark.skipif(not sys.platform.startswith("linux") or jemalloc_library() is None, reason="no jemalloc here")
def test_freed_pages_stay_resident_under_trainings_setting_until_purged(monkeypatch):
    """The setting keeps a freed 512 MiB tensor's pages for the next step; purge_freed_pages, which training calls
    after each validation, hands them back to the kernel."""
    monkeypatch.setenv("LD_PRELOAD", jemalloc_library())
    monkeypatch.setenv("MALLOC_CONF", MALLOC_CONF)
    monkeypatch.setenv(OPT_OUT, "jemalloc")
    code = (
        "import torch; from transformer.machine.allocator import purge_freed_pages, resident_gib\n"
        "before = resident_gib(); x = torch.ones(2**27); del x; kept = resident_gib()\n"  # 512 MiB of float32
        "purge_freed_pages(); print(before, kept, resident_gib())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, kept, purged = map(float, out.split())
    assert kept - before > 0.4  # GiB: freed, still resident
    assert kept - purged > 0.4


def test_training_purges_after_each_validation_or_each_epoch_without_one(monkeypatch):
    purges = []
    monkeypatch.setattr("transformer.training.memory.purge_freed_pages", lambda: purges.append("purged"))
    callback = hydra.utils.instantiate(check_overrides("train", []).callbacks.release_freed_memory)  # the real config
    callback.on_validation_end(None, None)
    callback.on_train_epoch_end(SimpleNamespace(enable_validation=True), None)  # purged at its validation's end
    assert purges == ["purged"]
    callback.on_train_epoch_end(SimpleNamespace(enable_validation=False), None)
    assert purges == ["purged", "purged"]


def test_a_purge_jemalloc_refuses_is_said_once_and_training_goes_on(monkeypatch, capsys):
    def refuse():
        raise OSError(14, "jemalloc's mallctl arena.4096.purge failed")

    monkeypatch.setattr("transformer.training.memory.purge_freed_pages", refuse)
    callback = ReleaseFreedMemory()
    callback.on_validation_end(None, None)
    callback.on_validation_end(None, None)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "arena.4096.purge failed" in lines[0] and "training goes on" in lines[0]
