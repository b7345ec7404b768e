"""Qwen3's vocabulary in numbers: one home for the ids every layer refers to (facts.md "Names").

The LM head has 151,936 rows (facts.md F2: the model's vocabulary); the tokenizer knows 151,643
byte-level BPE tokens plus 26 specials, so ids 151,669..151,935 are padding rows that a trained
model never emits.
"""

#: lm_head rows / logits per token (facts.md F2: vocab 151936).
VOCAB_SIZE = 151936
#: Number of real tokens: 151643 BPE ranks + 26 specials. Ids >= this are padding.
N_TOKENS = 151669
#: Number of byte-level BPE tokens (ids 0..151642).
N_BPE = 151643

ENDOFTEXT = 151643
IM_START = 151644
IM_END = 151645
THINK = 151667
END_THINK = 151668
#: Generation stops on either (facts.md "Names").
EOS_IDS = frozenset({IM_END, ENDOFTEXT})
