#!/usr/bin/env bash
# The runs of docs/sharing.md's table, one after another (each output also in runs/<name>.log),
# then the table. From the repository root: bash examples/sharing/run.sh [MNIST_NPZ]
set -euo pipefail
MNIST=${1:-../shared/data/mnist.npz}
RECIPE=(--source npz --data-file "$MNIST" --epochs 2 --batch-size 128 --seed 0 --overwrite)
mkdir -p runs
python examples/sharing/digits28.py runs/digits28.npz
# the backbone: one MLP on the 28x28 load_digits images (not MNIST)
meshensemble train --source npz --data-file runs/digits28.npz --model mlp --members 1 \
  --epochs 30 --workdir runs/backbone --overwrite 2>&1 | tee runs/backbone.log
meshensemble train "${RECIPE[@]}" --model mlp --members 1 --workdir runs/single 2>&1 | tee runs/single.log
meshensemble train "${RECIPE[@]}" --model mlp --members 8 --workdir runs/deep 2>&1 | tee runs/deep.log
meshensemble train "${RECIPE[@]}" --model be_mlp --members 8 --workdir runs/be 2>&1 | tee runs/be.log
meshensemble train "${RECIPE[@]}" --model mlp --members 8 --backbone runs/backbone --rank 4 \
  --workdir runs/lora 2>&1 | tee runs/lora.log
python examples/sharing/table.py single=runs/single deep=runs/deep be=runs/be lora=runs/lora
