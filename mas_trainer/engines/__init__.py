"""Engines generate for one policy; this package keeps torch out of plain imports.

`base`, `chat` and `fake` are torch-free and re-exported here, each loaded on first use. The
torch parts live in `mas_trainer.engines.models` (`load_model`, `load_tokenizer`) and
`mas_trainer.engines.torch_engine` (`TorchEngine`); import those modules directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_trainer._lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover
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

__getattr__ = lazy_exports(__name__, {
    "mas_trainer.engines.base": ["ChatFormat", "Engine", "Generation", "SamplingParams"],
    "mas_trainer.engines.chat": ["HFChatFormat", "parse_tool_calls"],
    "mas_trainer.engines.fake": ["FakeChatFormat", "FakeEngine"],
})
