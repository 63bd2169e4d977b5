"""What a model call is, as far as the gateway can tell from the request alone (record column `call_kind`).

- `compaction`: the harness asks for a summary of its own history, to continue from it. Told by the codec
  (`Conversation.compaction`: Codex's remote compaction — `…/responses/compact`, or a Responses call whose input
  ends with a `compaction_trigger` item), by a remote compaction endpoint, or by the harness's own compaction
  instruction in the prompt — fixed text in the pinned harness versions (package.json), listed below with where it
  comes from.
- `side`: no tools offered — titles, routing classifiers, next-speaker and loop checks, summaries of tool output.
  No harness runs its agent loop without tools.
- `main`: everything else (the agent loop, a subagent's loop).

After a compaction, the next `main` call that opens a new chain gets the reason "compaction", in merge and in the
gateway's token-exact chains alike (`polar_mitm/reconstruct/compaction_label.py`); side calls and further
compaction calls do not.
"""

from __future__ import annotations

from polar_mitm.codecs import is_compaction_path
from polar_mitm.conversation import Conversation

# (harness, the start of its compaction instruction) — checked in each harness's shipped source.
COMPACTION_MARKERS = (
    ("claude-code", "Your task is to create a detailed summary of the conversation so far"),
    ("codex (local compaction)", "You are performing a CONTEXT CHECKPOINT COMPACTION"),
    (
        "gemini",
        "You are a specialized system component responsible for distilling chat history into a structured",
    ),
    (
        "qwen",
        "You are the component that summarizes a conversation when its context window is about to overflow",
    ),
    (
        "opencode",
        "You are a context summarization agent. You are given a conversation between a user and an agent",
    ),
    ("pi", "The messages above are a conversation to summarize. Create a structured context checkpoint"),
    (
        "pi (split turn)",
        "This is the PREFIX of a turn that was too large to keep. The SUFFIX (recent work) is",
    ),
    (
        "pi (later compaction)",
        "The messages above are NEW conversation messages to incorporate into the existing",
    ),
    ("hermes", "You are a summarization agent creating a context checkpoint"),  # agent/context_compressor.py
    (  # openhands-sdk 1.21.0: context/condenser/prompts/summarizing_prompt.j2, a lone tool-free user message
        "openhands",
        "You are maintaining a context-aware state summary for an interactive agent.",
    ),
)


def call_kind(conv: Conversation, path: str) -> str:
    """main | side | compaction for one decoded request."""
    if conv.compaction or is_compaction_path(path) or _asks_for_compaction(conv):
        return "compaction"
    return "main" if conv.tools else "side"


def _asks_for_compaction(conv: Conversation) -> bool:
    """The harness's compaction instruction in its system prompt or its last user message."""
    texts = [m.content for m in conv.messages if m.role == "system"]
    last_user = next((m for m in reversed(conv.messages) if m.role == "user"), None)
    if last_user is not None:
        texts.append(last_user.content)
    return any(marker in text for text in texts for _, marker in COMPACTION_MARKERS)
