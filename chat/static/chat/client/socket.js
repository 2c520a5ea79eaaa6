// The WebSocket (reconnects and the resume handshake, as PartySocket and the published client do)
// and the transcript's HTTP reads.

import { parseJsonOr, randomId } from "./util.js";
import { config, isMessage, replaceTranscript, scheduleRender, setPending, showError, state } from "./state.js";
import { handleFrame } from "./frames.js";

const CONNECT_TIMEOUT_MS = 4000; // PartySocket's default
const MAX_BACKOFF_MS = 10000;
const TRANSCRIPT_TIMEOUT_MS = 5000;

// Everything hangs off the path chat.urls is mounted at (the host site may include it under any
// prefix, and mount the WebSocket routes under the same one), never the site's root.
function basePath() {
  return `${config.mount}agents/${encodeURIComponent(state.agent)}/${encodeURIComponent(state.name)}`;
}

function socketUrl() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  return `${scheme}://${location.host}${basePath()}?_pk=${encodeURIComponent(state.pk)}`;
}

export function send(frame) {
  const ws = state.socket;
  if (ws && state.connected && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(frame));
  else state.outbox.push(frame);
}

export function sendResumeProbe() {
  const probeId = randomId(8);
  state.probeIds.set(probeId, ++state.probeCount);
  send({ type: "cf_agent_stream_resume_request", probeId });
}

export function connect() {
  clearTimeout(state.reconnectTimer);
  const gen = ++state.socketGen;
  const ws = new WebSocket(socketUrl());
  Object.assign(state, { socket: ws, connected: false, probeCount: 0, probeIds: new Map(), ackedIds: new Map() });
  // A socket that never opens (half-open network) would otherwise stall reconnection.
  state.connectTimer = setTimeout(() => ws.readyState === WebSocket.CONNECTING && ws.close(), CONNECT_TIMEOUT_MS);
  const current = (fn) => (event) => gen === state.socketGen && fn(event);
  ws.addEventListener("open", current(onOpen));
  ws.addEventListener("message", current(onSocketMessage));
  ws.addEventListener("close", current(onClose));
  scheduleRender();
}

function onOpen() {
  clearTimeout(state.connectTimer);
  const reconnected = state.everConnected;
  state.connected = true;
  state.everConnected = true;
  sendResumeProbe(); // the same question the published client asks on every open
  flushOutbox();
  // Not every server pushes the transcript on connect; refetch whatever we missed while away.
  if (reconnected) loadTranscript(state.conversation);
  scheduleRender();
}

function flushOutbox() {
  const queued = state.outbox;
  state.outbox = [];
  for (const frame of queued) {
    // A request first sent on this socket is live here, so an idle answer to the probe must not end it.
    if (frame.type === "cf_agent_use_chat_request" && state.streams.has(frame.id)) state.streams.get(frame.id).live = true;
    send(frame);
  }
}

function onSocketMessage(event) {
  state.reconnectAttempt = 0; // the server is really talking: the next drop reconnects at once
  if (typeof event.data !== "string") return;
  const frame = parseJsonOr(event.data, null);
  if (frame) handleFrame(frame);
}

const CLOSE_REASONS = {
  4400: "bad conversation name",
  4403: "access denied (this conversation belongs to someone else, or you are not signed in)",
  4404: "unknown agent",
  4409: "you have too many conversations; open one of yours or delete some first",
  4429: "you have too many connections open (other tabs or windows); close some, then reload",
};

function isTerminalClose(code) {
  return code === 1008 || (code >= 4000 && code <= 4999);
}

function onClose(event) {
  clearTimeout(state.connectTimer);
  state.connected = false;
  for (const stream of state.streams.values()) stream.live = false;
  setPending(false);
  if (isTerminalClose(event.code)) {
    state.fatal = { code: event.code, reason: event.reason };
    // daphne sends no close reason, so the page knows the server's codes itself.
    const reason = event.reason || CLOSE_REASONS[event.code] || "closed by the server";
    showError(`Connection refused (${event.code}): ${reason}`);
  } else {
    scheduleReconnect();
  }
  scheduleRender();
}

function scheduleReconnect() {
  const attempt = state.reconnectAttempt++;
  const delay = attempt === 0 ? 0 : Math.min(1000 * 2 ** (attempt - 1), MAX_BACKOFF_MS);
  state.reconnectTimer = setTimeout(connect, delay);
}

export function closeSocket() {
  clearTimeout(state.reconnectTimer);
  clearTimeout(state.connectTimer);
  state.socketGen++; // detaches the old socket's handlers before it reports close
  if (state.socket) state.socket.close(1000, "conversation closed");
  Object.assign(state, { socket: null, connected: false });
}

export async function loadTranscript(conversation) {
  const version = state.transcriptVersion;
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), TRANSCRIPT_TIMEOUT_MS);
  try {
    const res = await fetch(`${basePath()}/get-messages`, {
      headers: { Accept: "application/json" },
      credentials: "same-origin",
      signal: controller.signal,
    });
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    const text = await res.text();
    const list = text.trim() ? JSON.parse(text) : [];
    // Drop the answer if the conversation or the transcript moved on while it was in flight.
    if (!Array.isArray(list) || conversation !== state.conversation || version !== state.transcriptVersion) return;
    replaceTranscript(list, res.headers.get("Think-Earlier") === "true");
    scheduleRender();
  } catch (err) {
    console.warn("thinkChat: could not load the transcript", err);
  } finally {
    clearTimeout(timer);
  }
}

// One page of older messages, before the first one shown.
export async function loadEarlier() {
  const first = state.older[0] || state.messages[0];
  if (!first) return;
  const conversation = state.conversation;
  try {
    const url = `${basePath()}/get-messages?before=${encodeURIComponent(first.id)}`;
    const res = await fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" });
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    const list = await res.json();
    if (!Array.isArray(list) || conversation !== state.conversation) return;
    const shown = new Set([...state.older, ...state.messages].map((m) => m.id));
    state.older = list.filter((m) => isMessage(m) && !shown.has(m.id)).concat(state.older);
    state.olderEarlier = res.headers.get("Think-Earlier") === "true";
    scheduleRender();
  } catch (err) {
    console.warn("thinkChat: could not load earlier messages", err);
  }
}
