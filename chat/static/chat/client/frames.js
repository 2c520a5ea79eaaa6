// Frames from the server (docs/protocol.md): each updates the client's state.

import {
  clearLocal,
  isMessage,
  isToolPart,
  replaceTranscript,
  scheduleRender,
  setPending,
  setRecovering,
  showError,
  state,
} from "./state.js";
import { applyChunk, ensureStream, finishStream, isDuplicate, parseChunk } from "./folding.js";
import { send } from "./socket.js";
import { answerAutomaticTools } from "./actions.js";

function onChatResponse(frame) {
  if (typeof frame.id !== "string") return;
  const body = typeof frame.body === "string" ? frame.body : "";
  const hasContent = frame.error || body.trim() !== "";
  // A bare terminal for a turn we never saw carries nothing to show.
  if (!state.streams.has(frame.id) && !hasContent) return;
  const stream = ensureStream(frame.id);
  if (stream.done) return; // stragglers after done, cancel or clear
  setPending(false);
  if (state.queued && state.queued.id === frame.id && (hasContent || frame.done)) state.queued = null;
  stream.live = true;
  if (frame.continuation) stream.continuation = true;
  if (hasContent && !isDuplicate(stream, frame)) {
    if (frame.error) showError(body || "Stream error");
    else {
      const chunk = parseChunk(body); // invalid JSON (e.g. "No response was generated.") is skipped
      if (chunk) applyChunk(stream, chunk);
      if (chunk && !frame.replay) answerAutomaticTools(chunk);
    }
  }
  if (frame.done) finishStream(stream, frame);
}

// On connect the server announces an active stream twice (unprompted, then answering our probe):
// ACK once per socket. Only an answer to a probe sent after that ACK (the one that follows a tool
// approval) re-enrols us in the pending-resume set and so needs a new ACK.
function needsAck(frame) {
  if (!state.ackedIds.has(frame.id)) return true;
  const probe = state.probeIds.get(frame.probeId);
  return probe !== undefined && probe > state.ackedIds.get(frame.id);
}

function onStreamResuming(frame) {
  if (typeof frame.id !== "string") return;
  setPending(false);
  if (!needsAck(frame)) return;
  state.ackedIds.set(frame.id, state.probeCount);
  const stream = ensureStream(frame.id);
  Object.assign(stream, { done: false, live: true, seq: -1, resetOnNext: true, stopping: false });
  send({ type: "cf_agent_stream_resume_ack", id: frame.id });
}

function onResumeNone(frame) {
  setPending(false);
  // Only an idle answer to one of our probes proves that turns from before the reconnect are over.
  if (frame.reason !== "idle" || !state.probeIds.has(frame.probeId)) return;
  for (const stream of state.streams.values()) {
    if (!stream.done && !stream.live) finishStream(stream, {});
  }
}

function onMessageUpdated(frame) {
  const updated = frame.message;
  if (!isMessage(updated)) return;
  let index = state.messages.findIndex((m) => m.id === updated.id);
  if (index < 0) {
    const ids = new Set(updated.parts.filter(isToolPart).map((p) => p.toolCallId));
    index = state.messages.findIndex((m) => m.parts.some((p) => isToolPart(p) && ids.has(p.toolCallId)));
  }
  if (index < 0) return; // updates never append
  const local = state.messages[index];
  if (isStreamingMessage(local.id)) mergeToolParts(local, updated);
  else state.messages[index] = updated;
  state.transcriptVersion++;
}

function isStreamingMessage(id) {
  for (const stream of state.streams.values()) if (!stream.done && stream.messageId === id) return true;
  return false;
}

function mergeToolParts(local, updated) {
  for (const part of updated.parts.filter(isToolPart)) {
    const mine = local.parts.find((p) => isToolPart(p) && p.toolCallId === part.toolCallId);
    if (mine) Object.assign(mine, part);
  }
}

// A turn of ours (or the one we are parked on) that the server accepted but cannot start yet: behind
// other turns of the conversation, or waiting for a free worker. Shown until its first chunk.
function onQueued(frame) {
  if (typeof frame.id !== "string") return;
  const stream = state.streams.get(frame.id);
  const ours = stream ? !stream.done && stream.seq < 0 && !stream.messageId : state.pendingId === frame.id;
  if (ours) state.queued = { id: frame.id, reason: frame.reason, position: frame.position };
}

function onStopped(frame) {
  const ids = Array.isArray(frame.requestIds) ? frame.requestIds : [];
  if (state.queued && ids.includes(state.queued.id)) state.queued = null;
  if (state.pendingId && ids.includes(state.pendingId)) setPending(false);
  state.recovering = false;
}

const FRAME_HANDLERS = {
  cf_agent_identity: (f) => (state.identity = { name: f.name, agent: f.agent }),
  cf_agent_chat_messages: (f) => Array.isArray(f.messages) && replaceTranscript(f.messages, f.earlier),
  cf_agent_message_updated: onMessageUpdated,
  cf_agent_use_chat_response: onChatResponse,
  cf_agent_stream_resuming: onStreamResuming,
  cf_agent_stream_resume_none: onResumeNone,
  cf_agent_stream_pending: (f) => setPending(true, f.id),
  cf_agent_chat_recovering: (f) => setRecovering(Boolean(f.recovering)),
  cf_agent_chat_queued: onQueued,
  cf_agent_chat_clear: clearLocal,
  cf_agent_chat_stopped: onStopped,
  cf_agent_chat_branch_refused: (f) => showError(`Could not switch branches: ${f.reason}`),
  cf_agent_tool_refused: (f) => showError(`Your answer was refused: ${f.reason}`),
};

export function handleFrame(frame) {
  if (!frame || typeof frame !== "object" || typeof frame.type !== "string") return;
  const handler = Object.prototype.hasOwnProperty.call(FRAME_HANDLERS, frame.type) && FRAME_HANDLERS[frame.type];
  if (!handler) return; // unknown frame types are ignored, as the published client does
  handler(frame);
  scheduleRender();
}
