"""Grammar-constrained decoding (structured outputs): what a request asks for (``spec``), the
grammars compiled against the tokenizer and one matcher per sequence (``matcher``, engine
process), and the token mask applied to a step's logits (``mask``, the sampling rank)."""

from moeserve.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
