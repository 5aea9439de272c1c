# lm-eval imports this file by path for the `!function` entries of the YAMLs beside it
from narrows.eval.taskdata import arc_easy, gsm8k_held_out, hellaswag, lambada, mmlu, piqa  # noqa: F401
