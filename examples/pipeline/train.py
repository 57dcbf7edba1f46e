"""Stage 1 of the pipeline example: fit a tiny linear model and save it to model.json."""
import json
import random

rng = random.Random(0)
xs = [rng.uniform(-1, 1) for _ in range(200)]
ys = [3.0 * x + 0.5 + rng.gauss(0, 0.1) for x in xs]
w = b = 0.0
for epoch in range(200):
    gw = sum((w * x + b - y) * x for x, y in zip(xs, ys)) / len(xs)
    gb = sum((w * x + b - y) for x, y in zip(xs, ys)) / len(xs)
    w, b = w - 0.5 * gw, b - 0.5 * gb
with open("model.json", "w") as f:
    json.dump({"w": w, "b": b}, f)
print(f"trained: w={w:.3f} b={b:.3f} -> model.json")
