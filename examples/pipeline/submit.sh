#!/bin/sh
# The pipeline train -> evaluate -> export as three jobs: each starts only after the one
# before it SUCCEEDED; if one fails, the rest fail with DEPENDENCY_FAILED and never run.
# Run from anywhere: sh examples/pipeline/submit.sh
set -e
dir=$(cd "$(dirname "$0")" && pwd)
train=$(gpuplane job submit -n train -g 0 -d "$dir" -- python train.py)
evaluate=$(gpuplane job submit -n evaluate -g 0 -d "$dir" --after "$train" -- python evaluate.py)
export=$(gpuplane job submit -n export -g 0 -d "$dir" --after "$evaluate" -- python export.py)
echo "train $train -> evaluate $evaluate -> export $export"
gpuplane logs -f "$export"
