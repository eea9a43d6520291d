#!/usr/bin/env bash
# Reproduce docs/results.md's mixed-corpus row: train experiment=mix_de_en_cpu (60 minutes), average the last
# epochs' checkpoints, evaluate them with beam 5 on every corpus's dev and test sets.
#
#   bash scripts/reproduce_mix.sh                      # needs data/{multi30k,tatoeba_deen,wmt_news_deen}
#   OUT=outputs/mine AVERAGE=3 bash scripts/reproduce_mix.sh trainer.max_time=00:00:10:00
#
# Extra arguments are Hydra overrides for training.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/reproduce_mix_cpu}
AVERAGE=${AVERAGE:-3}  # checkpoints averaged: the last N epochs' (the hour holds about 5)
SPLITS=${SPLITS:-"test_2016_flickr val tatoeba/test news/newstest2013"}

start=$SECONDS
python -m transformer.train experiment=mix_de_en_cpu "hydra.run.dir=$OUT" "$@"
echo $((SECONDS - start)) > "$OUT/wall_clock_s"
python -m transformer.average "$OUT/checkpoints" --last "$AVERAGE" --output "$OUT/checkpoints/average.pt"
for split in $SPLITS; do
  python -m transformer.evaluate "ckpt_path=$OUT/checkpoints/average.pt" "split=$split" \
    "hydra.run.dir=$OUT/evaluate/average_beam5_${split//\//.}"
done
