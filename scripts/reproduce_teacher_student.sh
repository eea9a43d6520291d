#!/usr/bin/env bash
# From teacher to deployable student (docs/teacher_student.md), de->en on Multi30k:
#   1. a reverse en->de model; it back-translates the English captions of Multi30k's images (beam, and sampled);
#   2. de->en teachers: the recipe alone (two seeds, for an ensemble) and with each back-translated corpus, tagged
#      __bt__, mixed in by each weight of BT_WEIGHTS;
#   3. the best teacher on val (a single model or the ensemble) translates Multi30k's German and the German
#      captions with beam search: the distilled corpus;
#   4. students (model=tiny and model=deep_shallow) trained on the distilled corpus and on the original data;
#   5. the best single teacher and the distilled students exported to int8 behind the parity gate, each plain and
#      with a lexical shortlist (vmap.txt) from its own training pairs;
#   6. every model evaluated (EMA weights, beam 5), one table at the end, with int8 speed on 1 and 2 threads.
# Every model trains STEPS steps. Each stage skips what is done and resumes what was stopped: run it again after a
# stop. Extra arguments are Hydra overrides for every training run (a stage's own, such as model=, come after them).
#
#   bash scripts/reproduce_teacher_student.sh                        # the recipe's step budget (hours per model on a CPU)
#   STEPS=1500 OUT=outputs/ts_short bash scripts/reproduce_teacher_student.sh
#   SPLITS=val bash scripts/reproduce_teacher_student.sh             # while choosing: no test split
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/teacher_student}
STEPS=${STEPS:-4738}                     # the recipe's steps in an hour on its machines (docs/results.md)
MAIN=${MAIN:-data/multi30k}              # the parallel corpus: train, val and the test split
CAPTIONS=${CAPTIONS:-data/multi30k_captions}  # monolingual: train.{1..5}.{de,en}.gz
CAPTION_LINES=${CAPTION_LINES:-0}        # 0: every caption; N: the first N of each language (a small run)
BT_WEIGHTS=${BT_WEIGHTS:-"1.0 0.5"}      # the back-translated corpus's sampling weight; Multi30k's is 1.0
SPLITS=${SPLITS:-"val test_2016_flickr"}  # scored splits of MAIN; val chooses, the test split reports
TEST_SPLIT=${TEST_SPLIT:-test_2016_flickr}
EXPERIMENT=${EXPERIMENT:-multi30k_de_en_cpu}
EXPORT_ARGS=${EXPORT_ARGS:-}             # extra export overrides
SAVE_EVERY=${SAVE_EVERY:-50}             # training steps between last.ckpt writes (and at every validation)
TRAIN_ARGS=("$@")

machine() {  # the processor (and GPU) this start trains on, for the table: minutes belong to one machine
  local cpu isa gpu
  cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
  isa=$({ grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo || true; } | sort -u \
    | sed 's/avx2/AVX2/; s/avx512f/AVX-512/; s/avx512_bf16/BF16/; s/amx_tile/AMX/' | paste -sd ' ')
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1) || gpu=  # none, or no driver
  echo "${cpu:-unknown CPU} (${isa:-no AVX2}, $(nproc) cores)${gpu:+ + $gpu}"
}

train() {  # train NAME OVERRIDES...: the run folder $OUT/NAME, resumed where it stopped, skipped once done
  local run=$OUT/$1
  shift
  [[ -f $run/done ]] && return 0
  local resume=()
  [[ -f $run/checkpoints/last.ckpt ]] && resume=(ckpt_path=last)
  if [[ -f $run/wall_clock_s.start && ${#resume[@]} -gt 0 ]]; then  # a start that was killed: its seconds up to
    local started on  # its last save, on its machine
    read -r started on < "$run/wall_clock_s.start" || [[ -n ${started:-} ]]  # a last line without its newline
    local kept=$(($(stat -c %Y "$run/checkpoints/last.ckpt") - started))
    if ((kept > 0)); then echo "$kept $on" >> "$run/wall_clock_s"; fi
  fi
  mkdir -p "$run"
  local on
  on=$(machine)
  echo "$(date +%s) $on" > "$run/wall_clock_s.start"
  local start=$SECONDS precision=()
  [[ -f $OUT/precision ]] && precision=("trainer.precision=$(cat "$OUT/precision")")
  # last.ckpt every SAVE_EVERY steps too: a start killed without a signal (a session's end) loses less
  python -m transformer.train "experiment=$EXPERIMENT" "data.path=$MAIN" "data.test_split=$TEST_SPLIT" \
    "trainer.max_steps=$STEPS" trainer.max_time=null "callbacks.last_checkpoint.every_n_train_steps=$SAVE_EVERY" \
    ${precision[@]+"${precision[@]}"} "hydra.run.dir=$run" ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"} "$@" \
    ${resume[@]+"${resume[@]}"}
  echo "$((SECONDS - start)) $on" >> "$run/wall_clock_s"  # seconds, then the machine: one line per start
  rm "$run/wall_clock_s.start"
  touch "$run/done"
}

evaluate() {  # evaluate NAME CKPT_PATH [OVERRIDES...]: $OUT/eval/NAME/SPLIT/ for each split, EMA weights, beam 5
  local name=$1 ckpt=$2
  shift 2
  for split in $SPLITS; do
    local dir=$OUT/eval/$name/$split
    [[ -f $dir/done ]] && continue
    python -m transformer.evaluate "ckpt_path=$ckpt" ema=true "data.path=$MAIN" "split=$split" beam_size=5 \
      "hydra.run.dir=$dir" "$@"
    touch "$dir/done"
  done
}

lines() {  # lines FILES...: their lines, the first CAPTION_LINES of them if set
  ls "$@" > /dev/null  # every file there: the || true below is for head closing the pipe early, not for them
  if [[ $CAPTION_LINES -gt 0 ]]; then { zcat "$@" || true; } | head -n "$CAPTION_LINES"; else zcat "$@"; fi
}

ckpt() { echo "$OUT/$1/checkpoints/last.ckpt"; }

names() {  # names FILE NAME...: $OUT/FILE holds the names, rewritten only when they change
  local file=$OUT/$1
  shift
  [[ $(cat "$file" 2> /dev/null) == "$*" ]] || echo "$*" > "$file"
}

mkdir -p "$OUT/input"
for lang in en de; do
  if [[ ! -f $OUT/input/captions.$lang.gz ]]; then
    lines "$CAPTIONS"/train.{1..5}.$lang.gz | gzip > "$OUT/input/captions.$lang.gz.partial"
    mv "$OUT/input/captions.$lang.gz.partial" "$OUT/input/captions.$lang.gz"
  fi
done

# 1. the reverse model and the back-translations
train reverse data.src=en data.tgt=de
# Every later model trains in the reverse model's precision (trainer.precision=auto chose it for this machine), so
# the compared models share one, wherever each starts; an argument trainer.precision=... sets another for all.
if [[ ! -f $OUT/precision ]]; then
  chosen=$(python -c "import sys; from transformer.training.resume import load_checkpoint
print(load_checkpoint(sys.argv[1])['precision'])" "$(ckpt reverse)")
  echo "$chosen" > "$OUT/precision"
fi
python -m transformer.translate "ckpt_path=$(ckpt reverse)" ema=true "input=$OUT/input/captions.en.gz" \
  "output=$OUT/bt_beam" beam_size=5
python -m transformer.translate "ckpt_path=$(ckpt reverse)" ema=true "input=$OUT/input/captions.en.gz" \
  "output=$OUT/bt_sampled" beam_size=1 sampling_topk=-1 seed=1

# 2. teachers, named once for the table and the teacher's choice: OUT/teachers, OUT/ensemble_members
members=(base base_seed2)
teachers=("${members[@]}")
for source in beam sampled; do for weight in $BT_WEIGHTS; do teachers+=("bt_${source}_w$weight"); done; done
names ensemble_members "${members[@]}"
names teachers "${teachers[@]}"
train base seed=1
train base_seed2 seed=2
for source in beam sampled; do
  for weight in $BT_WEIGHTS; do
    train "bt_${source}_w$weight" "+data.corpora.bt.path=$OUT/bt_$source" +data.corpora.bt.tag=__bt__ \
      "+data.corpora.bt.weight=$weight"
  done
done
for name in "${teachers[@]}"; do evaluate "$name" "$(ckpt "$name")"; done
paths=()
for member in "${members[@]}"; do paths+=("$(ckpt "$member")"); done
ensemble_ckpt="[$(IFS=,; echo "${paths[*]}")]"
evaluate ensemble "$ensemble_ckpt"

# 3. the distilled corpus, from the best teacher on val
# chosen once: the distilled corpus is its translation, whatever later runs score
if [[ ! -f $OUT/teacher ]]; then
  chosen=$(python scripts/teacher_student_table.py "$OUT" --best-teacher)
  echo "$chosen" > "$OUT/teacher"
fi
teacher=$(cat "$OUT/teacher")
echo "teacher: $teacher"
if [[ $teacher == ensemble ]]; then teacher_ckpt=$ensemble_ckpt; else teacher_ckpt=$(ckpt "$teacher"); fi
if [[ ! -f $OUT/input/distill.de.gz ]]; then
  { zcat "$MAIN/train.de.gz"; zcat "$OUT/input/captions.de.gz"; } | gzip > "$OUT/input/distill.de.gz.partial"
  mv "$OUT/input/distill.de.gz.partial" "$OUT/input/distill.de.gz"
fi
python -m transformer.translate "ckpt_path=$teacher_ckpt" ema=true "input=$OUT/input/distill.de.gz" \
  "output=$OUT/distilled" beam_size=5
for split in $(echo "val $SPLITS $TEST_SPLIT" | tr ' ' '\n' | sort -u); do  # its dev and test sets: MAIN's
  for lang in de en; do
    [[ -f $MAIN/$split.$lang.gz ]] || { echo "error: $MAIN/$split.$lang.gz is missing; MAIN needs it" >&2; exit 2; }
    ln -sfn "$(realpath "$MAIN/$split.$lang.gz")" "$OUT/distilled/$split.$lang.gz"
  done
done

# 4. students
for model in tiny deep_shallow; do
  train "student_${model}_distilled" "model=$model" "data.path=$OUT/distilled"
  train "student_${model}_original" "model=$model"
  evaluate "student_${model}_distilled" "$(ckpt "student_${model}_distilled")"
  evaluate "student_${model}_original" "$(ckpt "student_${model}_original")"
done

# 5. int8 exports of the best single teacher and the distilled students, plain and shortlisted (NAME_shortlist)
single=$(python scripts/teacher_student_table.py "$OUT" --best-teacher --single)
for name in "$single" student_tiny_distilled student_deep_shallow_distilled; do
  for shortlist in false true; do
    folder=$OUT/export/$name
    [[ $shortlist == true ]] && folder+=_shortlist
    [[ -f $folder/model.bin ]] && continue
    python -m transformer.export "ckpt_path=$(ckpt "$name")" ema=true quantization=int8 "shortlist=$shortlist" \
      "output=$folder" "parity_input=$MAIN/$TEST_SPLIT.de.gz" "parity_references=$MAIN/$TEST_SPLIT.en.gz" $EXPORT_ARGS
  done
done

# 6. the table
python scripts/teacher_student_table.py "$OUT" --speed "$MAIN/$TEST_SPLIT.de.gz" | tee "$OUT/table.md"
