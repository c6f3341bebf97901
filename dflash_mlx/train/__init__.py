"""Training drafters against a frozen target.

prompts.py, corpus.py  what to train on: built-in prompts, standard-library text
data.py                the target's own responses (`train make-data`)
continuations.py       plain continuations of text files, for a base model (`make-data --text`)
labels.py              the target's pass: features and the labels it implies
packing.py             many blocks of many sequences in one drafter pass
loss.py                the weighted, restricted-head loss (+ distillation, + selector)
drafter.py             a new drafter, a grown one, DFlash 1 -> DFlash 2
fit.py                 the optimizer loop (`train fit`)
checkpoint.py          resumable checkpoints and the exported release
evaluate.py            held-out tau in the real decode loop (`train eval`)
"""
