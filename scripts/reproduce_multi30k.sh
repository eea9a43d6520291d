#!/usr/bin/env bash
# Reproduce docs/results.md: train a Multi30k recipe in both directions, average the last epochs' checkpoints,
# evaluate on val and test_2016_flickr, print the table.
#
#   bash scripts/reproduce_multi30k.sh            # the 60-minute CPU recipe, de->en then en->de (~2 h 15 min)
#   RECIPE=gpu bash scripts/reproduce_multi30k.sh # the one-GPU recipe (6,000 steps)
#   PAIRS="de-en" OUT=outputs/mine bash scripts/reproduce_multi30k.sh
#   SPLITS=val PAIRS=de-en OUT=outputs/vocab6k bash scripts/reproduce_multi30k.sh data.vocab_size=6000  # tuning
#
# Extra arguments are Hydra overrides for training, e.g. trainer.max_time=00:00:10:00.
set -euo pipefail
cd "$(dirname "$0")/.."
RECIPE=${RECIPE:-cpu}
OUT=${OUT:-outputs/reproduce_multi30k_${RECIPE}}
PAIRS=${PAIRS:-"de-en en-de"}
SPLITS=${SPLITS:-"val test_2016_flickr"}  # val alone while choosing settings; the test split once per chosen one
# checkpoints averaged: the CPU recipe's last 10 epochs (10 scored best on the validation split), the GPU recipe's
# last 5 kept (every 500 steps)
if [[ $RECIPE == gpu ]]; then AVERAGE=${AVERAGE:-5}; else AVERAGE=${AVERAGE:-10}; fi

runs=()
for pair in $PAIRS; do
  src=${pair%-*} tgt=${pair#*-} run=$OUT/$pair
  start=$SECONDS
  python -m transformer.train "experiment=multi30k_de_en_${RECIPE}" "data.src=$src" "data.tgt=$tgt" \
    "hydra.run.dir=$run" "$@"
  echo $((SECONDS - start)) > "$run/wall_clock_s"
  python -m transformer.average "$run/checkpoints" --last "$AVERAGE" --output "$run/checkpoints/average.pt"
  # The last checkpoint decoded greedily on test (as the peer decodes), then the average with beam search.
  if [[ " $SPLITS " == *" test_2016_flickr "* ]]; then
    python -m transformer.evaluate "ckpt_path=$run/checkpoints/last.ckpt" beam_size=1 "hydra.run.dir=$run/evaluate/last_greedy"
  fi
  for split in $SPLITS; do
    python -m transformer.evaluate "ckpt_path=$run/checkpoints/average.pt" "split=$split" \
      "hydra.run.dir=$run/evaluate/average_beam5_$split"
  done
  runs+=("$run")
done
python scripts/results_table.py "${runs[@]}"
