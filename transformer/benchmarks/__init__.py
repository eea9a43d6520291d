"""What the benchmarks (benchmarks/), the maintainer tools (tools/) and the tests share: the machine's description and
process memory (machine), the peer models the benchmarks compare against (peers), the timed training loop
(training), a generated corpus for the tiny model (corpus), dispatched ops (dispatch), attention calls (kernel_calls)
and GPU probes (gpu). Writing into docs/ is benchmarks/report.py's, outside the package. Import the module you need;
this one imports nothing."""
