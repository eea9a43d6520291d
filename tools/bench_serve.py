"""The server against the same model's offline throughput, in one run: 1, 8 and 64 clients each sending one sentence
at a time for a fixed time; sentences/s, p50/p95/p99 latency, errors; and the server's resident memory after
2,000 and after 20,000 requests. The server and the offline peer run on the same cores (--server-cpus), the
clients on the others, so that the load generator does not take the server's CPU.

    python tools/bench_serve.py --model deploy/de-en-int8 --sentences data/multi30k/test_2016_flickr.de.gz
"""

import argparse
import http.client
import json
import os
import statistics
import threading
import time
from pathlib import Path

from common.server import start_server
from transformer.data.sources import read_lines
from transformer.machine.allocator import status_kib
from transformer.translators import SearchConfig, open_translator


def read_sentences(path: str) -> list[str]:
    return [line.strip() for line in read_lines(Path(path)) if line.strip()]


def load(port: int, sentences: list[str], pair: tuple[str, str], clients: int, seconds: float | None,
         requests: int | None = None) -> tuple[list[float], int]:  # fmt: skip
    """Latencies of the requests answered, and the errors, with `clients` keep-alive clients sending one sentence
    each, for `seconds` or until `requests` have been sent."""
    latencies, errors, lock = [], [0], threading.Lock()
    end = time.perf_counter() + (seconds or 1e9)
    sent = iter(range(requests or 10**12))

    def client(i: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        n = i
        while time.perf_counter() < end:
            with lock:
                if next(sent, None) is None:
                    return
            body = json.dumps({"q": sentences[n % len(sentences)], "source": pair[0], "target": pair[1]})
            start = time.perf_counter()
            try:
                connection.request("POST", "/translate", body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                response.read()
                ok = response.status == 200
            except OSError:
                ok = False
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            with lock:
                latencies.append(time.perf_counter() - start) if ok else errors.__setitem__(0, errors[0] + 1)
            n += clients

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, errors[0]


def cpu_list(text: str) -> list[int]:
    """0,2-3 as [0, 2, 3]."""
    cpus = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--sentences", required=True)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--beam-size", type=int, default=4)  # the server's default
    parser.add_argument("--server-cpus", default=None, help="e.g. 0 or 0-3: the server's and the peer's cores "
                        "(default: the first half); the clients take the rest")  # fmt: skip
    parser.add_argument("--workers", type=int, default=1, help="the server's workers= (engine calls at once)")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus = set(cpu_list(args.server_cpus)) if args.server_cpus else set(cpus[: max(1, len(cpus) // 2)])
    client_cpus = set(cpus) - server_cpus or server_cpus
    sentences = read_sentences(args.sentences)
    os.sched_setaffinity(0, server_cpus)  # the peer on the server's cores, with as many threads
    translator = open_translator(args.model, threads=len(server_cpus))
    pair = translator.data["src"], translator.data["tgt"]
    search = SearchConfig(beam_size=args.beam_size)
    start_time = time.perf_counter()
    translator.translate(sentences, search)
    offline = len(sentences) / (time.perf_counter() - start_time)
    single = []
    for sentence in sentences[:200]:
        t = time.perf_counter()
        translator.translate([sentence], search)
        single.append(time.perf_counter() - t)
    del translator
    server, port = start_server([args.model], "max_queue_sentences=100000", f"threads={len(server_cpus)}",
                                f"workers={args.workers}", quiet=False, cpus=server_cpus)  # fmt: skip
    os.sched_setaffinity(0, client_cpus)
    try:
        print(f"server and peer on cores {sorted(server_cpus)}, clients on {sorted(client_cpus)}")
        print(f"offline: {offline:.1f} sentences/s in one call; one sentence a call: median "
              f"{1000 * statistics.median(single):.1f} ms")  # fmt: skip
        print("| clients | sentences/s | x offline | p50 ms | p95 ms | p99 ms | errors |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for clients in map(int, args.clients.split(",")):
            latencies, errors = load(port, sentences, pair, clients, args.seconds)
            q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [latencies[0]] * 99
            rate = len(latencies) / args.seconds
            print(f"| {clients} | {rate:.1f} | {rate / offline:.2f} | {1000 * q[49]:.1f} | {1000 * q[94]:.1f} | "
                  f"{1000 * q[98]:.1f} | {errors} |")  # fmt: skip
        load(port, sentences, pair, 64, None, 2000)
        after_2k = status_kib("VmRSS", server.pid) / 1024
        load(port, sentences, pair, 64, None, 18000)
        after_20k = status_kib("VmRSS", server.pid) / 1024
        print(f"resident memory: {after_2k:.0f} MiB after 2,000 requests, {after_20k:.0f} MiB after 20,000 "
              f"({100 * (after_20k / after_2k - 1):+.1f}%)")  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
