"""Engines generate for one policy; this package keeps torch out of plain imports.

`base`, `chat` and `fake` are torch-free and re-exported here. The torch parts live in
`mas_trainer.engines.models` (`load_model`, `load_tokenizer`) and
`mas_trainer.engines.torch_engine` (`TorchEngine`); import those modules directly.
"""

from mas_trainer.engines.base import ChatFormat, Engine, Generation, SamplingParams
from mas_trainer.engines.chat import HFChatFormat, parse_tool_calls
from mas_trainer.engines.fake import FakeChatFormat, FakeEngine

__all__ = [
    "SamplingParams",
    "Generation",
    "Engine",
    "ChatFormat",
    "HFChatFormat",
    "parse_tool_calls",
    "FakeEngine",
    "FakeChatFormat",
]
