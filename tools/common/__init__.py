"""What the benchmarks and maintainer tools beside this package (tools/) and the tests share: the machine's
description and process memory (machine), the peer models the benchmarks compare against (peers), the timed training
loop (training), a generated corpus for the tiny model (corpus), dispatched ops (dispatch), attention calls recorded
and judged (kernel_calls), GPU probes (gpu), a WMT-shaped corpus (wmt_shaped), a live server (server) and the writer
of benchmark sections in docs/ (report). Outside the package: nothing here ships in the wheel. Import the module you
need; this one imports nothing."""
