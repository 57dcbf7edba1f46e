"""Stage 3: export the evaluated model (here: a copy with its evaluation beside it)."""
import json

model, ev = json.load(open("model.json")), json.load(open("eval.json"))
json.dump({**model, "eval": ev}, open("exported.json", "w"), indent=1)
print("exported.json written")
