// The protocol client's state: the conversation, its transcript, streams and socket bookkeeping.
// No DOM here: what the page must show goes through `view`.

import { uuid4 } from "./util.js";

const PENDING_TIMEOUT_MS = 60000; // the client's probe timeout after stream_pending

export const state = {
  agent: "",
  name: "",
  conversation: 0, // bumped on every open, so late async results for an old conversation are dropped
  pk: uuid4(), // one connection id per page load, reused on reconnect like PartySocket
  socket: null,
  socketGen: 0,
  connected: false,
  everConnected: false,
  fatal: null, // {code, reason} after a 4xxx/1008 close: no reconnect
  reconnectAttempt: 0,
  reconnectTimer: null,
  connectTimer: null,
  outbox: [], // frames sent while disconnected, flushed on open (as PartySocket does)
  probeCount: 0, // resume probes sent on the current socket
  probeIds: new Map(), // probeId -> its number on the current socket
  ackedIds: new Map(), // request id -> probeCount when we ACKed it on the current socket
  identity: null,
  messages: [],
  // The server sends a long conversation's newest messages only (a window); `earlier` says older ones
  // exist. Pages loaded with the button are shown above the window and never sent back.
  earlier: false,
  older: [],
  olderEarlier: false,
  transcriptVersion: 0, // bumped by every local or server transcript change
  streams: new Map(), // request id -> stream fold state
  pending: false,
  pendingId: null,
  pendingTimer: null,
  recovering: false,
  queued: null, // {id, reason, position}: an accepted turn that waits (cf_agent_chat_queued)
  attachments: [], // File objects chosen for the next message (uploaded when it is sent)
  uploading: false,
  renderQueued: false,
  answered: new Set(), // client tool calls this page already answered
  drafts: new Map(), // tool call id -> the answer typed so far
};

// Filled in from the page's context by page.js (readConfig) when it starts.
export const config = { agents: [], defaultAgent: "assistant", mount: "/" };

// What the page does for the client (page.js fills these in): the client never touches the DOM.
export const view = { scheduleRender() {}, showError() {}, hideError() {} };

export function scheduleRender() {
  view.scheduleRender();
}

export function showError(text) {
  view.showError(text);
}

export function hideError() {
  view.hideError();
}

export function isMessage(m) {
  return m && typeof m === "object" && typeof m.id === "string" && Array.isArray(m.parts);
}

export function findMessage(id) {
  return state.messages.find((m) => m.id === id) || null;
}

export function lastAssistant() {
  for (let i = state.messages.length - 1; i >= 0; i--) {
    if (state.messages[i].role === "assistant") return state.messages[i];
  }
  return null;
}

export function isToolPart(part) {
  return part && (part.type === "dynamic-tool" || (typeof part.type === "string" && part.type.startsWith("tool-")));
}

export function toolName(part) {
  return part.type === "dynamic-tool" ? part.toolName || "tool" : part.type.slice(5);
}

// Tool updates may target an earlier message (an approved tool runs in the continuation).
export function findToolPart(toolCallId, preferred) {
  const candidates = preferred ? [preferred, ...state.messages.slice().reverse()] : state.messages.slice().reverse();
  for (const m of candidates) {
    const part = m.parts.find((p) => isToolPart(p) && p.toolCallId === toolCallId);
    if (part) return part;
  }
  return null;
}

export function mergeMetadata(message, metadata) {
  if (metadata && typeof metadata === "object") message.metadata = Object.assign({}, message.metadata, metadata);
}

// A server snapshot wins, except for messages this socket is streaming right now:
// the snapshot may predate chunks we have already rendered.
export function replaceTranscript(list, earlier) {
  const incoming = list.filter(isMessage);
  state.earlier = Boolean(earlier);
  const ids = new Set(incoming.map((m) => m.id));
  state.older = state.earlier ? state.older.filter((m) => !ids.has(m.id)) : [];
  for (const stream of state.streams.values()) {
    if (stream.done || !stream.live || !stream.messageId) continue;
    const mine = findMessage(stream.messageId);
    if (!mine) continue;
    const i = incoming.findIndex((m) => m.id === mine.id);
    // A continuation folds onto the message it continues, which the server stores whole when it
    // finishes: until then, our copy is ahead of the server's.
    if (i >= 0) incoming[i] = mine;
    else incoming.push(mine);
  }
  state.messages = incoming;
  state.transcriptVersion++;
}

export function clearLocal() {
  state.messages = [];
  state.older = [];
  state.earlier = false;
  state.transcriptVersion++;
  // Mark rather than drop streams, so stragglers for a cleared turn are ignored.
  for (const stream of state.streams.values()) stream.done = true;
  setPending(false);
  state.recovering = false;
  state.queued = null;
  hideError();
}

export function activeStream() {
  let active = null;
  for (const stream of state.streams.values()) if (!stream.done) active = stream;
  return active;
}

export function setPending(on, id) {
  clearTimeout(state.pendingTimer);
  state.pending = on;
  state.pendingId = on && typeof id === "string" ? id : null;
  // Like the client's probe timeout: never stay "waiting" forever if the server goes quiet.
  if (on) state.pendingTimer = setTimeout(expirePending, PENDING_TIMEOUT_MS);
}

function expirePending() {
  setPending(false);
  scheduleRender();
}

export function setRecovering(on) {
  state.recovering = on;
}

// A new conversation starts with empty state (page.js resets what is shown).
export function resetConversation(name, agent) {
  for (const stream of state.streams.values()) stream.done = true;
  setPending(false);
  Object.assign(state, {
    name,
    agent,
    conversation: state.conversation + 1,
    messages: [],
    streams: new Map(),
    outbox: [],
    identity: null,
    fatal: null,
    everConnected: false,
    reconnectAttempt: 0,
    recovering: false,
  });
  state.transcriptVersion++;
}

// Tool calls that wait for someone (an approval, a client tool's answer), read once per transcript.
let waitingMemo = { version: -1, count: 0 };
function waitingToolCalls() {
  if (waitingMemo.version === state.transcriptVersion) return waitingMemo.count;
  let count = 0;
  for (const message of state.messages) {
    if (message.role !== "assistant") continue;
    for (const part of message.parts || []) {
      if (part.state === "approval-requested" || (part.state === "input-available" && part.toolCallId && isToolPart(part))) count++;
    }
  }
  waitingMemo = { version: state.transcriptVersion, count };
  return count;
}

// "Stop everything" when there is more than the one turn the Stop button ends.
export function somethingQueued() {
  let open = 0;
  for (const stream of state.streams.values()) if (!stream.done) open++;
  return Boolean(state.queued) || open > 1 || state.recovering || waitingToolCalls() > 0;
}

export function isBusy() {
  return state.pending || activeStream() !== null;
}

// Priority: a missing socket hides everything, then recovery, then streaming.
export function currentStatus() {
  if (!state.connected && !state.fatal) return "reconnecting";
  if (state.recovering) return "recovering";
  if (isBusy()) return "streaming";
  return "idle";
}
