"""No frame leaves over the WebSocket server's message limit (issue 21, item 7): deltas are cut in pieces
(chat.turn.chunking.coalesce) and any other frame too large is sent smaller (chat.wire.oversize)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from chat import protocol as p
from chat.transcript.window import TRUNCATED_KEY
from chat.turn.chunking import DELTA_PIECE_CHARS, coalesce
from chat.wire.oversize import SEND_LIMIT_BYTES, fit_frame, fits
from recovery.stream.encoding import dumps


def delta(text: str, part: str = "t1") -> dict[str, Any]:
    return {"type": "text-delta", "id": part, "delta": text}


def test_a_delta_longer_than_a_piece_is_cut_in_pieces_that_join_to_it() -> None:
    text = "".join(str(i % 10) for i in range(3 * DELTA_PIECE_CHARS + 500))
    chunks = coalesce([delta(text)])
    assert [len(c["delta"]) for c in chunks] == [DELTA_PIECE_CHARS] * 3 + [500]
    assert "".join(c["delta"] for c in chunks) == text
    assert all(c["id"] == "t1" and c["type"] == "text-delta" for c in chunks)


def test_small_deltas_merge_up_to_a_piece_and_no_further() -> None:
    words = [delta("word ") for _ in range(40_000)]  # 200,000 characters
    chunks = coalesce(words)
    assert all(len(c["delta"]) <= DELTA_PIECE_CHARS for c in chunks)
    assert len(chunks) == 4, [len(c["delta"]) for c in chunks]
    assert "".join(c["delta"] for c in chunks) == "word " * 40_000


def test_deltas_of_different_parts_or_kinds_stay_apart() -> None:
    chunks = coalesce([delta("a"), delta("b", "t2"), {"type": "reasoning-delta", "id": "t2", "delta": "c"}])
    assert [c.get("delta") for c in chunks] == ["a", "b", "c"]


def test_a_worst_case_batch_of_deltas_makes_frames_under_the_send_limit() -> None:
    # Half a megabyte of newlines (a flush's most) is 1.5 MB once escaped twice in one frame.
    chunks = coalesce([delta("\n" * 1000) for _ in range(512)])
    frames = [p.chunk_frame(json.dumps("r1"), dumps(c), seq) for seq, c in enumerate(chunks)]
    assert max(len(f.encode()) for f in frames) < SEND_LIMIT_BYTES
    assert "".join(json.loads(json.loads(f)["body"])["delta"] for f in frames) == "\n" * 512_000


def test_a_frame_that_fits_is_sent_as_it_is() -> None:
    frame = p.response_frame("r1", dumps(delta("hello")), seq=3)
    assert fits(frame) and fit_frame(frame) is frame


def test_a_stream_chunk_over_the_limit_becomes_a_placeholder_with_its_seq() -> None:
    chunk = {"type": "tool-output-available", "toolCallId": "c1", "output": "x" * 1_200_000}
    frame = p.response_frame("r1", dumps(chunk), seq=7, continuation=True)
    assert not fits(frame)
    sent = json.loads(fit_frame(frame))
    assert (sent["type"], sent["id"], sent["seq"], sent["continuation"]) == (
        p.USE_CHAT_RESPONSE,
        "r1",
        7,
        True,
    )
    body = json.loads(sent["body"])
    assert body == {
        "type": "data-think-omitted",
        "data": {"reason": "too_large", "bytes": len(frame.encode())},
        "transient": True,
    }


def test_a_limit_counts_bytes_not_characters() -> None:
    frame = p.response_frame("r1", dumps(delta("é" * 300_000)), seq=1)  # 600 KB of UTF-8
    assert fits(frame)
    assert not fits(frame, limit=500_000)
    assert json.loads(json.loads(fit_frame(frame, limit=500_000))["body"])["type"] == "data-think-omitted"


def message(text: str, message_id: str = "a1") -> dict[str, Any]:
    return {"id": message_id, "role": "assistant", "parts": [{"type": "text", "text": text}]}


def test_a_message_update_over_the_limit_carries_the_message_cut_for_display() -> None:
    frame = p.message_updated_frame(message("y" * 2_000_000))
    sent = fit_frame(frame)
    assert len(sent.encode()) <= SEND_LIMIT_BYTES
    shown = json.loads(sent)["message"]
    assert shown["id"] == "a1" and shown["metadata"][TRUNCATED_KEY]["bytes"] > 2_000_000
    assert shown["parts"][0]["text"].startswith("yyy")


def test_a_transcript_frame_over_the_limit_cuts_its_largest_messages_only() -> None:
    messages = [message("small", "s1"), message("z" * 900_000, "b1"), message("w" * 900_000, "b2")]
    sent = fit_frame(p.chat_messages_frame(messages, earlier=True))
    assert len(sent.encode()) <= SEND_LIMIT_BYTES
    frame = json.loads(sent)
    assert frame["earlier"] is True
    assert frame["messages"][0] == messages[0]
    assert [TRUNCATED_KEY in (m.get("metadata") or {}) for m in frame["messages"]] == [False, True, True]


def test_a_frame_of_another_kind_over_the_limit_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="cf_agent_identity frame of"):
        fit_frame(json.dumps({"type": "cf_agent_identity", "name": "n" * SEND_LIMIT_BYTES}))
