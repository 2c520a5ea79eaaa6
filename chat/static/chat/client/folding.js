// Folding AI SDK UI message chunks (the bodies of cf_agent_use_chat_response) into messages.

import { parseJsonOr, randomId } from "./util.js";
import { findMessage, findToolPart, lastAssistant, mergeMetadata, showError, state } from "./state.js";

const MAX_FINISHED_STREAMS = 50;

export function newStream(id) {
  return {
    id,
    messageId: null,
    continuation: false,
    baseline: null, // parts count of the continued message before this stream
    seq: -1, // highest applied seq
    done: false,
    live: true, // receiving on the current socket
    resetOnNext: false,
    stopping: false,
    open: { text: new Map(), reasoning: new Map() },
    toolInput: new Map(),
  };
}

export function ensureStream(id) {
  let stream = state.streams.get(id);
  if (!stream) {
    stream = newStream(id);
    state.streams.set(id, stream);
  }
  return stream;
}

function resetFold(stream) {
  stream.open = { text: new Map(), reasoning: new Map() };
  stream.toolInput = new Map();
}

// A replay starts at chunk 0, so whatever was rendered for this request is rebuilt.
function resetStreamMessage(stream) {
  stream.resetOnNext = false;
  resetFold(stream);
  const message = stream.messageId && findMessage(stream.messageId);
  if (!message) return;
  if (stream.continuation) {
    if (stream.baseline !== null) message.parts.length = Math.min(message.parts.length, stream.baseline);
  } else {
    message.parts = [];
  }
}

function newAssistant(id) {
  return { id, role: "assistant", parts: [] };
}

// The message chunks are folded into; continuations extend the last assistant message.
function targetMessage(stream) {
  const known = stream.messageId && findMessage(stream.messageId);
  if (known) return known;
  const last = stream.continuation ? lastAssistant() : null;
  if (last) {
    stream.messageId = last.id;
    stream.baseline = last.parts.length;
    return last;
  }
  const message = newAssistant(`asst-${stream.id}-${randomId(4)}`);
  state.messages.push(message);
  stream.messageId = message.id;
  stream.baseline = stream.continuation ? 0 : null;
  return message;
}

function startMessage(stream, chunk) {
  const id = typeof chunk.messageId === "string" && chunk.messageId ? chunk.messageId : null;
  if (stream.continuation || !id) return targetMessage(stream);
  resetFold(stream);
  let message = findMessage(id);
  const previous = stream.messageId && stream.messageId !== id ? findMessage(stream.messageId) : null;
  // A second start under one request is a retried attempt: it replaces the abandoned partial.
  const at = previous ? state.messages.indexOf(previous) : -1;
  if (previous) state.messages.splice(at, 1);
  if (message) {
    message.role = "assistant";
    message.parts = [];
  } else {
    message = newAssistant(id);
    if (at >= 0) state.messages.splice(at, 0, message);
    else state.messages.push(message);
  }
  stream.messageId = id;
  return message;
}

function openPart(stream, kind, message, id) {
  const part = { type: kind, text: "", state: "streaming" };
  message.parts.push(part);
  stream.open[kind].set(id, part);
  return part;
}

function closeOpenParts(stream) {
  for (const kind of ["text", "reasoning"]) {
    for (const part of stream.open[kind].values()) part.state = "done";
    stream.open[kind].clear();
  }
}

function upsertToolPart(stream, message, chunk) {
  let part = findToolPart(chunk.toolCallId, message);
  if (!part) {
    part = chunk.dynamic
      ? { type: "dynamic-tool", toolName: chunk.toolName, toolCallId: chunk.toolCallId }
      : { type: `tool-${chunk.toolName}`, toolCallId: chunk.toolCallId };
    message.parts.push(part);
  }
  return part;
}

function updateToolPart(message, chunk, changes) {
  const part = findToolPart(chunk.toolCallId, message);
  if (part) Object.assign(part, changes);
}

const FOLDERS = {
  start: (s, m, c) => mergeMetadata(m, c.messageMetadata),
  "start-step": (s, m) => m.parts.push({ type: "step-start" }),
  "finish-step": (s) => closeOpenParts(s),
  "text-start": (s, m, c) => openPart(s, "text", m, c.id),
  "text-delta": (s, m, c) => appendDelta(s, "text", m, c),
  "text-end": (s, m, c) => endPart(s, "text", c.id),
  "reasoning-start": (s, m, c) => openPart(s, "reasoning", m, c.id),
  "reasoning-delta": (s, m, c) => appendDelta(s, "reasoning", m, c),
  "reasoning-end": (s, m, c) => endPart(s, "reasoning", c.id),
  "tool-input-start": (s, m, c) => {
    Object.assign(upsertToolPart(s, m, c), { state: "input-streaming", input: undefined });
    s.toolInput.set(c.toolCallId, "");
  },
  "tool-input-delta": (s, m, c) => {
    const text = (s.toolInput.get(c.toolCallId) || "") + (c.inputTextDelta || "");
    s.toolInput.set(c.toolCallId, text);
    updateToolPart(m, c, { input: parseJsonOr(text, text) });
  },
  "tool-input-available": (s, m, c) =>
    Object.assign(upsertToolPart(s, m, c), { state: "input-available", input: c.input }),
  "tool-input-error": (s, m, c) =>
    Object.assign(upsertToolPart(s, m, c), { state: "output-error", input: c.input, errorText: c.errorText }),
  "tool-approval-request": (s, m, c) =>
    updateToolPart(m, c, { state: "approval-requested", approval: { id: c.approvalId } }),
  "tool-output-available": (s, m, c) =>
    updateToolPart(m, c, { state: "output-available", output: c.output, preliminary: c.preliminary }),
  "tool-output-error": (s, m, c) => updateToolPart(m, c, { state: "output-error", errorText: c.errorText }),
  "tool-output-denied": (s, m, c) => updateToolPart(m, c, { state: "output-denied" }),
  "source-url": (s, m, c) => m.parts.push({ type: "source-url", sourceId: c.sourceId, url: c.url, title: c.title }),
  "source-document": (s, m, c) =>
    m.parts.push({ type: "source-document", sourceId: c.sourceId, mediaType: c.mediaType, title: c.title }),
  file: (s, m, c) => m.parts.push({ type: "file", url: c.url, mediaType: c.mediaType }),
  "message-metadata": (s, m, c) => mergeMetadata(m, c.messageMetadata),
  finish: (s, m, c) => {
    closeOpenParts(s);
    mergeMetadata(m, c.messageMetadata);
  },
  abort: (s) => closeOpenParts(s),
};

function appendDelta(stream, kind, message, chunk) {
  // Be lenient about a missing *-start: keep the text rather than lose it.
  const part = stream.open[kind].get(chunk.id) || openPart(stream, kind, message, chunk.id);
  part.text += typeof chunk.delta === "string" ? chunk.delta : "";
}

function endPart(stream, kind, id) {
  const part = stream.open[kind].get(id);
  if (part) part.state = "done";
  stream.open[kind].delete(id);
}

function foldData(stream, message, chunk) {
  if (chunk.transient) return; // transient data is an event, not transcript content
  const existing = chunk.id !== undefined && message.parts.find((p) => p.type === chunk.type && p.id === chunk.id);
  if (existing) existing.data = chunk.data;
  else message.parts.push({ type: chunk.type, id: chunk.id, data: chunk.data });
}

export function applyChunk(stream, chunk) {
  if (chunk.type === "error") {
    showError(chunk.errorText || "Stream error");
    return;
  }
  const fold = FOLDERS[chunk.type] || (chunk.type.startsWith("data-") ? foldData : null);
  if (!fold) return; // unknown (e.g. ai v7 only) chunk types are skipped
  if (stream.resetOnNext) resetStreamMessage(stream);
  const message = chunk.type === "start" ? startMessage(stream, chunk) : targetMessage(stream);
  fold(stream, message, chunk);
}

export function parseChunk(body) {
  const chunk = parseJsonOr(body, null);
  return chunk && typeof chunk === "object" && typeof chunk.type === "string" ? chunk : null;
}

// seq dedupe applies to content frames only: control frames (done, replayComplete) are idempotent.
export function isDuplicate(stream, frame) {
  if (typeof frame.seq !== "number") return false;
  if (frame.seq <= stream.seq) return true;
  stream.seq = frame.seq;
  return false;
}

export function finishStream(stream, frame) {
  closeOpenParts(stream);
  stream.done = true;
  stream.live = false;
  if (frame.outcome === "recovering") state.recovering = true;
  pruneStreams();
}

function pruneStreams() {
  const finished = [...state.streams.values()].filter((s) => s.done);
  for (const stream of finished.slice(0, Math.max(0, finished.length - MAX_FINISHED_STREAMS))) {
    state.streams.delete(stream.id);
  }
}
