"""Stage 2: evaluate model.json on fresh data; fails (exit 1) if it is not good enough,
so the export after it never runs on a bad model."""
import json
import random
import sys

model = json.load(open("model.json"))
rng = random.Random(1)
xs = [rng.uniform(-1, 1) for _ in range(100)]
mse = sum((model["w"] * x + model["b"] - (3.0 * x + 0.5)) ** 2 for x in xs) / len(xs)
print(f"eval mse={mse:.5f}")
json.dump({"mse": mse}, open("eval.json", "w"))
sys.exit(0 if mse < 0.01 else 1)
