"""The continual-learning methods, one file each (methods/base.py says what a method is):

    sft, replay, opr-ru/sc/low/random, mtl, sdft, sft-kl, ewc, lwf, agem, ssr
    each of them on LoRA adapters as <name>+lora (methods/lora.py), sft+lora also as lora-seqft
        (TRACE's row)
    olora, ilora (LoRA only)

METHODS: run.py's --methods names -> Method; OBJECTIVES: train.py's --objective names -> Objective.
"""
from methods import agem, ewc, ilora, lora, lwf, mtl, olora, opr, replay, sdft, sft, sft_kl, ssr

# full fine-tuning, the paper's
FULL = {m.name: m for m in (sft.METHOD, replay.METHOD, *opr.METHODS, mtl.METHOD, sdft.METHOD,
                            sft_kl.METHOD, ewc.METHOD, lwf.METHOD, agem.METHOD, ssr.METHOD)}
METHODS = {**FULL, "lora-seqft": lora.on_lora(sft.METHOD, "lora-seqft"), "olora": olora.METHOD,
           "ilora": ilora.METHOD,
           **{f"{n}+lora": lora.on_lora(m) for n, m in FULL.items()}}
OBJECTIVES = {o.name: o for o in (sft.OBJECTIVE, sft_kl.OBJECTIVE, sdft.OBJECTIVE, ewc.OBJECTIVE,
                                  lwf.OBJECTIVE, agem.OBJECTIVE, olora.OBJECTIVE, ilora.OBJECTIVE)}
