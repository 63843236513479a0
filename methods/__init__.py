"""The continual-learning methods, one file each (methods/base.py says what a method is):

    sft, replay, opr-ru/sc/low/random, mtl, sdft, sft-kl, ewc, lwf, agem, ssr

METHODS: run.py's --methods names -> Method; OBJECTIVES: train.py's --objective names -> Objective.
"""
from methods import agem, ewc, lwf, mtl, opr, replay, sdft, sft, sft_kl, ssr

METHODS = {m.name: m for m in (sft.METHOD, replay.METHOD, *opr.METHODS, mtl.METHOD, sdft.METHOD, sft_kl.METHOD,
                               ewc.METHOD, lwf.METHOD, agem.METHOD, ssr.METHOD)}
OBJECTIVES = {o.name: o for o in (sft.OBJECTIVE, sft_kl.OBJECTIVE, sdft.OBJECTIVE, ewc.OBJECTIVE,
                                            lwf.OBJECTIVE, agem.OBJECTIVE)}
