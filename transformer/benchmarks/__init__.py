"""What the scripts in scripts/ share: the machine's description and the docs/*.md writer (report), process memory
(machine), the peer models the benchmarks compare against (peers), the timed training loop (training) and a
generated corpus for the tiny model (corpus). Import the module you need; this one imports nothing."""
