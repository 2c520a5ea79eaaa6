/*
 * Think chat page: a dependency-free browser client for the Cloudflare Agents
 * `cf_agent_*` chat protocol (docs/protocol.md).
 *
 * It mirrors what the published `agents` client does (PartySocket reconnects,
 * the resume handshake, AI SDK chunk folding) in plain JavaScript so the page
 * needs no build step. Model output is only ever written with textContent.
 */
(function () {
  "use strict";

  const RECENT_KEY = "thinkChat.recent";
  const RECENT_MAX = 10;
  const CONNECT_TIMEOUT_MS = 4000; // PartySocket's default
  const MAX_BACKOFF_MS = 10000;
  const PENDING_TIMEOUT_MS = 60000; // the client's probe timeout after stream_pending
  const TRANSCRIPT_TIMEOUT_MS = 5000;
  const MAX_FINISHED_STREAMS = 50;
  const ID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-";
  // Client tools this page offers the model (sent as the request body's clientTools): the browser
  // answers get_local_time itself; ask_user shows a box where the person types the answer.
  const CLIENT_TOOLS = [
    {
      name: "ask_user",
      description: "Ask the person using this page a question and wait for their answer.",
      parameters: { type: "object", properties: { question: { type: "string" } }, required: ["question"] },
    },
    {
      name: "get_local_time",
      description: "The current date, time and time zone of the person's browser.",
      parameters: { type: "object", properties: {} },
    },
  ];
  const AUTO_TOOLS = {
    get_local_time: () => ({
      iso: new Date().toISOString(),
      timeZone: Intl.DateTimeFormat().resolvedOptions().timeZone,
    }),
  };

  // ---------------------------------------------------------------- ids

  // crypto.getRandomValues works on plain http too; randomUUID needs a secure context.
  function randomId(size) {
    const bytes = crypto.getRandomValues(new Uint8Array(size));
    let id = "";
    for (const b of bytes) id += ID_ALPHABET[b & 63];
    return id;
  }

  function uuid4() {
    if (typeof crypto.randomUUID === "function") return crypto.randomUUID();
    const b = crypto.getRandomValues(new Uint8Array(16));
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    const hex = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
    return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
  }

  function randomName() {
    const bytes = crypto.getRandomValues(new Uint8Array(6));
    return "chat-" + Array.from(bytes, (b) => (b % 36).toString(36)).join("");
  }

  // ---------------------------------------------------------------- state

  const state = {
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

  const els = {};
  let config = { agents: [], defaultAgent: "assistant", mount: "/" };
  let renderCache = new Map(); // message id -> {sig, node}

  // ---------------------------------------------------------------- transcript helpers

  function isMessage(m) {
    return m && typeof m === "object" && typeof m.id === "string" && Array.isArray(m.parts);
  }

  function findMessage(id) {
    return state.messages.find((m) => m.id === id) || null;
  }

  function lastAssistant() {
    for (let i = state.messages.length - 1; i >= 0; i--) {
      if (state.messages[i].role === "assistant") return state.messages[i];
    }
    return null;
  }

  function isToolPart(part) {
    return part && (part.type === "dynamic-tool" || (typeof part.type === "string" && part.type.startsWith("tool-")));
  }

  function toolName(part) {
    return part.type === "dynamic-tool" ? part.toolName || "tool" : part.type.slice(5);
  }

  // Tool updates may target an earlier message (an approved tool runs in the continuation).
  function findToolPart(toolCallId, preferred) {
    const candidates = preferred ? [preferred, ...state.messages.slice().reverse()] : state.messages.slice().reverse();
    for (const m of candidates) {
      const part = m.parts.find((p) => isToolPart(p) && p.toolCallId === toolCallId);
      if (part) return part;
    }
    return null;
  }

  function mergeMetadata(message, metadata) {
    if (metadata && typeof metadata === "object") message.metadata = Object.assign({}, message.metadata, metadata);
  }

  // A server snapshot wins, except for messages this socket is streaming right now:
  // the snapshot may predate chunks we have already rendered.
  function replaceTranscript(list, earlier) {
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

  function clearLocal() {
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

  // ---------------------------------------------------------------- stream folding

  function newStream(id) {
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

  function ensureStream(id) {
    let stream = state.streams.get(id);
    if (!stream) {
      stream = newStream(id);
      state.streams.set(id, stream);
    }
    return stream;
  }

  function activeStream() {
    let active = null;
    for (const stream of state.streams.values()) if (!stream.done) active = stream;
    return active;
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

  function applyChunk(stream, chunk) {
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

  function parseJsonOr(text, fallback) {
    try {
      return JSON.parse(text);
    } catch {
      return fallback;
    }
  }

  function parseChunk(body) {
    const chunk = parseJsonOr(body, null);
    return chunk && typeof chunk === "object" && typeof chunk.type === "string" ? chunk : null;
  }

  // seq dedupe applies to content frames only: control frames (done, replayComplete) are idempotent.
  function isDuplicate(stream, frame) {
    if (typeof frame.seq !== "number") return false;
    if (frame.seq <= stream.seq) return true;
    stream.seq = frame.seq;
    return false;
  }

  function finishStream(stream, frame) {
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

  // ---------------------------------------------------------------- other frames

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

  function setPending(on, id) {
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

  // A turn of ours (or the one we are parked on) that the server accepted but cannot start yet: behind
  // other turns of the conversation, or waiting for a free worker. Shown until its first chunk.
  function onQueued(frame) {
    if (typeof frame.id !== "string") return;
    const stream = state.streams.get(frame.id);
    const ours = stream ? !stream.done && stream.seq < 0 && !stream.messageId : state.pendingId === frame.id;
    if (ours) state.queued = { id: frame.id, reason: frame.reason, position: frame.position };
  }

  function queuedLabel(id) {
    const queued = state.queued;
    if (!queued || queued.id !== id) return null;
    const ahead = Number.isInteger(queued.position) && queued.position > 0 ? ` (${queued.position} ahead)` : "";
    return queued.reason === "workers" ? "queued: waiting for a worker…" : `queued${ahead}…`;
  }

  function setRecovering(on) {
    state.recovering = on;
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

  function handleFrame(frame) {
    if (!frame || typeof frame !== "object" || typeof frame.type !== "string") return;
    const handler = Object.prototype.hasOwnProperty.call(FRAME_HANDLERS, frame.type) && FRAME_HANDLERS[frame.type];
    if (!handler) return; // unknown frame types are ignored, as the published client does
    handler(frame);
    scheduleRender();
  }

  // ---------------------------------------------------------------- socket

  // Everything hangs off the path chat.urls is mounted at (the host site may include it under any
  // prefix, and mount the WebSocket routes under the same one), never the site's root.
  function basePath() {
    return `${config.mount}agents/${encodeURIComponent(state.agent)}/${encodeURIComponent(state.name)}`;
  }

  function socketUrl() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    return `${scheme}://${location.host}${basePath()}?_pk=${encodeURIComponent(state.pk)}`;
  }

  function send(frame) {
    const ws = state.socket;
    if (ws && state.connected && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(frame));
    else state.outbox.push(frame);
  }

  function sendResumeProbe() {
    const probeId = randomId(8);
    state.probeIds.set(probeId, ++state.probeCount);
    send({ type: "cf_agent_stream_resume_request", probeId });
  }

  function connect() {
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

  function closeSocket() {
    clearTimeout(state.reconnectTimer);
    clearTimeout(state.connectTimer);
    state.socketGen++; // detaches the old socket's handlers before it reports close
    if (state.socket) state.socket.close(1000, "conversation closed");
    Object.assign(state, { socket: null, connected: false });
  }

  async function loadTranscript(conversation) {
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
  async function loadEarlier() {
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

  // ---------------------------------------------------------------- conversations

  function parseHash() {
    const raw = location.hash.replace(/^#/, "");
    if (!raw) return null;
    const slash = raw.indexOf("/");
    const agent = slash > 0 ? safeDecode(raw.slice(0, slash)) : null;
    if (agent && config.agents.includes(agent)) return { agent, name: safeDecode(raw.slice(slash + 1)) };
    return { agent: null, name: safeDecode(raw) };
  }

  function safeDecode(text) {
    try {
      return decodeURIComponent(text);
    } catch {
      return text;
    }
  }

  // "#name" for the default agent, "#agent/name" otherwise, so a reload reopens the same thing.
  function hashFor(name, agent) {
    const encoded = encodeURIComponent(name);
    return agent === config.defaultAgent ? `#${encoded}` : `#${encodeURIComponent(agent)}/${encoded}`;
  }

  async function openConversation(name, agent) {
    name = (name || "").trim() || randomName();
    agent = config.agents.includes(agent) ? agent : config.defaultAgent;
    closeSocket();
    resetConversation(name, agent);
    const conversation = state.conversation;
    if (location.hash !== hashFor(name, agent)) location.hash = hashFor(name, agent);
    rememberRecent(name, agent); // also re-renders the recent list, which changes only here
    render();
    // Transcript first, then the socket, so replayed frames fold onto the loaded history.
    await loadTranscript(conversation);
    if (conversation === state.conversation) connect();
  }

  function resetConversation(name, agent) {
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
    renderCache = new Map();
    els.messages.replaceChildren();
    els.name.value = name;
    els.agent.value = agent;
    hideError();
  }

  function readRecent() {
    try {
      const list = JSON.parse(localStorage.getItem(RECENT_KEY) || "[]");
      return Array.isArray(list) ? list.filter((r) => r && typeof r.name === "string") : [];
    } catch {
      return [];
    }
  }

  function rememberRecent(name, agent) {
    const list = readRecent().filter((r) => !(r.name === name && r.agent === agent));
    list.unshift({ name, agent });
    try {
      localStorage.setItem(RECENT_KEY, JSON.stringify(list.slice(0, RECENT_MAX)));
    } catch {
      // Storage can be full or disabled (private mode); recents are a convenience only.
    }
    renderRecent();
  }

  // ---------------------------------------------------------------- user actions

  // An attached file goes up first (chat.wire.files): the server checks it and answers the file part
  // (its URL) the message carries. A refusal (too big, a type not accepted) is shown and nothing is sent.
  async function uploadFile(file) {
    const url = `${config.mount}files/${encodeURIComponent(state.agent)}/${encodeURIComponent(state.name)}`;
    const form = new FormData();
    form.append("file", file, file.name);
    const res = await fetch(url, {
      method: "POST",
      body: form,
      credentials: "same-origin",
      headers: { "X-CSRFToken": csrfToken(), Accept: "application/json" },
    });
    if (!res.ok) throw new Error(`${file.name}: ${(await res.text()) || `HTTP ${res.status}`}`);
    return res.json();
  }

  function csrfToken() {
    const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    return match ? decodeURIComponent(match[1]) : "";
  }

  async function submitMessage(text) {
    text = (text || "").trim();
    const files = state.attachments.slice();
    if ((!text && !files.length) || isBusy() || state.fatal || state.uploading) return false;
    const conversation = state.conversation;
    let fileParts = [];
    if (files.length) {
      state.uploading = true;
      renderStatus();
      try {
        fileParts = await Promise.all(files.map(uploadFile));
      } catch (error) {
        showError(error.message || String(error));
        return false;
      } finally {
        state.uploading = false;
        renderStatus();
      }
      if (conversation !== state.conversation) return false; // another conversation was opened meanwhile
    }
    state.attachments = [];
    renderAttachments();
    const parts = text ? [{ type: "text", text }, ...fileParts] : fileParts;
    return submitParts(parts);
  }

  function submitText(text) {
    text = (text || "").trim();
    return text ? submitParts([{ type: "text", text }]) : false;
  }

  function submitParts(parts) {
    if (isBusy() || state.fatal) return false;
    const message = { id: randomId(16), role: "user", parts };
    state.messages.push(message);
    state.transcriptVersion++;
    const requestId = randomId(8);
    state.streams.set(requestId, newStream(requestId));
    hideError();
    const body = JSON.stringify({ messages: state.messages, trigger: "submit-message", clientTools: CLIENT_TOOLS });
    send({ type: "cf_agent_use_chat_request", id: requestId, init: { method: "POST", body } });
    scheduleRender();
    return true;
  }

  // Regenerate the last answer: the server keeps the one it replaces as a branch (docs/protocol.md).
  function regenerate() {
    if (isBusy() || state.fatal) return;
    const last = state.messages[state.messages.length - 1];
    if (!last || last.role !== "assistant") return;
    const messages = state.messages.slice(0, -1);
    state.messages = messages;
    state.transcriptVersion++;
    const requestId = randomId(8);
    state.streams.set(requestId, newStream(requestId));
    hideError();
    const body = JSON.stringify({ messages, trigger: "regenerate-message", clientTools: CLIENT_TOOLS });
    send({ type: "cf_agent_use_chat_request", id: requestId, init: { method: "POST", body } });
    scheduleRender();
  }

  // Show another branch after a message; the server answers every tab with the transcript.
  function switchBranch(anchorId, index) {
    if (isBusy() || state.fatal) return;
    send({ type: "cf_agent_chat_branch", anchorId, index });
  }

  function stopTurn() {
    const stream = activeStream();
    const id = stream ? stream.id : state.pendingId;
    if (!id) return;
    if (stream) stream.stopping = true;
    // The server answers with done; until then later frames for this turn still render.
    send({ type: "cf_agent_chat_request_cancel", id });
    scheduleRender();
  }

  // Stop everything of the conversation (cf_agent_chat_stop): the running turn, queued ones, tools
  // waiting for a human, a recovery in progress. Every tab gets the ends and cf_agent_chat_stopped.
  function stopEverything() {
    for (const stream of state.streams.values()) if (!stream.done) stream.stopping = true;
    send({ type: "cf_agent_chat_stop" });
    scheduleRender();
  }

  function onStopped(frame) {
    const ids = Array.isArray(frame.requestIds) ? frame.requestIds : [];
    if (state.queued && ids.includes(state.queued.id)) state.queued = null;
    if (state.pendingId && ids.includes(state.pendingId)) setPending(false);
    state.recovering = false;
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
  function somethingQueued() {
    let open = 0;
    for (const stream of state.streams.values()) if (!stream.done) open++;
    return Boolean(state.queued) || open > 1 || state.recovering || waitingToolCalls() > 0;
  }

  function clearChat() {
    send({ type: "cf_agent_chat_clear" });
    clearLocal();
    scheduleRender();
  }

  // A client tool's answer: the server stores it and continues the turn once every call has one.
  function answerTool(toolCallId, name, output) {
    if (state.answered.has(toolCallId)) return;
    state.answered.add(toolCallId);
    send({ type: "cf_agent_tool_result", toolCallId, toolName: name, output, autoContinue: true, clientTools: CLIENT_TOOLS });
    const part = findToolPart(toolCallId);
    if (part) {
      Object.assign(part, { state: "output-available", output });
      state.transcriptVersion++;
    }
    sendResumeProbe(); // be parked on the continuation, as the published hook does
    scheduleRender();
  }

  // Tools the browser answers by itself, as soon as their input is complete.
  function answerAutomaticTools(chunk) {
    const run = chunk.type === "tool-input-available" && AUTO_TOOLS[chunk.toolName];
    if (run) answerTool(chunk.toolCallId, chunk.toolName, run(chunk.input || {}));
  }

  function respondToApproval(toolCallId, approved) {
    send({ type: "cf_agent_tool_approval", toolCallId, approved, autoContinue: true });
    const part = findToolPart(toolCallId);
    if (part) {
      part.state = approved ? "approval-responded" : "output-denied";
      part.approval = Object.assign({}, part.approval, { approved });
      state.transcriptVersion++;
    }
    // As the published hook does: ask to be parked on the continuation the server schedules.
    sendResumeProbe();
    scheduleRender();
  }

  // ---------------------------------------------------------------- status

  function isBusy() {
    return state.pending || activeStream() !== null;
  }

  // Priority: a missing socket hides everything, then recovery, then streaming.
  function currentStatus() {
    if (!state.connected && !state.fatal) return "reconnecting";
    if (state.recovering) return "recovering";
    if (isBusy()) return "streaming";
    return "idle";
  }

  function statusLabel(status) {
    if (state.fatal) return "disconnected";
    if (status === "reconnecting") return state.everConnected ? "reconnecting…" : "connecting…";
    if (status === "recovering") return "recovering…";
    if (status === "idle") return "idle";
    const stream = activeStream();
    if (stream && stream.stopping) return "stopping…";
    if (!stream || !stream.messageId) return queuedLabel(stream ? stream.id : state.pendingId) || "waiting for the model…";
    return "streaming…";
  }

  function showError(text) {
    els.errorText.textContent = String(text);
    els.errorBanner.hidden = false;
  }

  function hideError() {
    els.errorText.textContent = "";
    els.errorBanner.hidden = true;
  }

  // ---------------------------------------------------------------- rendering

  function h(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value !== undefined && value !== null && value !== false) node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  function pretty(value) {
    if (typeof value === "string") return value;
    try {
      return JSON.stringify(value, null, 2);
    } catch {
      return String(value);
    }
  }

  function safeHref(url) {
    return typeof url === "string" && /^https?:\/\//i.test(url) ? url : null;
  }

  function renderText(part, kind) {
    return h("div", { class: `part part-${kind}`, "data-part-state": part.state }, part.text || "");
  }

  function renderReasoning(part, index) {
    const label = part.state === "streaming" ? "Reasoning (thinking…)" : "Reasoning";
    return h(
      "details",
      { class: "part part-reasoning", "data-part-index": index },
      h("summary", {}, label),
      h("div", { class: "reasoning-text" }, part.text || ""),
    );
  }

  function renderTool(part) {
    const box = h("div", { class: "part part-tool", "data-tool-call-id": part.toolCallId, "data-state": part.state });
    box.append(
      h(
        "div",
        { class: "tool-header" },
        h("span", { class: "tool-name" }, toolName(part)),
        h("span", { class: "tool-state" }, part.state || "pending"),
      ),
    );
    if (part.input !== undefined) box.append(h("div", { class: "tool-label" }, "input"), h("pre", {}, pretty(part.input)));
    if (part.output !== undefined) box.append(h("div", { class: "tool-label" }, "output"), h("pre", {}, pretty(part.output)));
    if (part.errorText) box.append(h("div", { class: "tool-error" }, String(part.errorText)));
    if (part.state === "input-available" && toolName(part) === "ask_user" && !state.answered.has(part.toolCallId)) {
      box.append(
        h(
          "form",
          { class: "tool-answer", "data-action": "answer" },
          // A re-render (more chunks of the turn) keeps what the person has typed so far.
          h("input", {
            type: "text",
            name: "answer",
            "aria-label": "Your answer",
            placeholder: "Your answer",
            value: state.drafts.get(part.toolCallId),
          }),
          h("button", { type: "submit" }, "Answer"),
        ),
      );
    }
    if (part.state === "approval-requested") {
      box.append(
        h(
          "div",
          { class: "tool-actions" },
          h("button", { type: "button", "data-action": "approve" }, "Approve"),
          h("button", { type: "button", "data-action": "reject", class: "secondary" }, "Reject"),
        ),
      );
    }
    return box;
  }

  // A file the server keeps is one of its own URLs (a path on this site); anything else is shown by name.
  function fileHref(url) {
    return typeof url === "string" && url.startsWith("/") && !url.startsWith("//") ? url : null;
  }

  function renderFile(part) {
    const label = part.filename || part.mediaType || "attachment";
    const href = fileHref(part.url);
    if (href && typeof part.mediaType === "string" && part.mediaType.startsWith("image/")) {
      return h("div", { class: "part part-file" }, h("img", { class: "part-image", src: href, alt: label, loading: "lazy" }));
    }
    return h("div", { class: "part part-file" }, href ? h("a", { href, download: label }, label) : `file: ${label}`);
  }

  function renderAttachments() {
    els.attachments.replaceChildren(
      ...state.attachments.map((file, index) =>
        h(
          "li",
          { class: "attachment" },
          file.name,
          h("button", { type: "button", class: "attachment-remove", "data-index": index, "aria-label": `Remove ${file.name}` }, "×"),
        ),
      ),
    );
    els.attachments.hidden = !state.attachments.length;
  }

  function renderPart(part, index) {
    if (!part || typeof part.type !== "string") return null;
    if (part.type === "text") return renderText(part, "text");
    if (part.type === "reasoning") return renderReasoning(part, index);
    if (isToolPart(part)) return renderTool(part);
    if (part.type === "source-url") {
      const href = safeHref(part.url);
      const label = part.title || part.url || "source";
      return h("div", { class: "part part-source" }, href ? h("a", { href, rel: "noopener noreferrer", target: "_blank" }, label) : label);
    }
    if (part.type === "source-document") return h("div", { class: "part part-source" }, part.title || "document");
    if (part.type === "file") return renderFile(part);
    if (part.type.startsWith("data-")) {
      return h("details", { class: "part part-data", "data-part-index": index }, h("summary", {}, part.type), h("pre", {}, pretty(part.data)));
    }
    return null; // step-start and unknown parts have no visible form
  }

  function renderMessage(message) {
    const role = typeof message.role === "string" ? message.role : "assistant";
    const body = h("div", { class: "message-body" });
    message.parts.forEach((part, index) => {
      const node = renderPart(part, index);
      if (node) body.append(node);
    });
    const note = message.metadata && message.metadata.thinkBranch;
    const nav =
      note && note.count > 1
        ? h(
            "div",
            { class: "branch-nav", "data-anchor-id": note.anchorId },
            h("button", { type: "button", "data-branch": note.index - 1, disabled: note.index <= 0, "aria-label": "previous version" }, "‹"),
            h("span", { class: "branch-label" }, `${note.index + 1}/${note.count}`),
            h("button", { type: "button", "data-branch": note.index + 1, disabled: note.index >= note.count - 1, "aria-label": "next version" }, "›"),
          )
        : null;
    const last = state.messages[state.messages.length - 1];
    const again =
      role === "assistant" && last && last.id === message.id
        ? h("button", { type: "button", class: "regenerate secondary", "data-regenerate": "" }, "Regenerate")
        : null;
    return h(
      "article",
      { class: `message message-${role}`, "data-role": role, "data-message-id": message.id },
      h("div", { class: "message-role" }, role, nav),
      body,
      again,
    );
  }

  // Re-rendering a message must not collapse what the reader expanded.
  function keepExpanded(oldNode, newNode) {
    for (const details of oldNode.querySelectorAll("details[open][data-part-index]")) {
      const twin = newNode.querySelector(`details[data-part-index="${details.dataset.partIndex}"]`);
      if (twin) twin.open = true;
    }
    // An answer box the person may be typing into moves over as it is (its value, focus and caret), so a
    // re-render (more chunks, the transcript after the turn) never loses a keystroke.
    for (const input of oldNode.querySelectorAll("[data-tool-call-id] form[data-action='answer'] input")) {
      const id = input.closest("[data-tool-call-id]").dataset.toolCallId;
      const twin = [...newNode.querySelectorAll("[data-tool-call-id]")].find((b) => b.dataset.toolCallId === id);
      const slot = twin && twin.querySelector("form[data-action='answer'] input");
      if (!slot) continue;
      const focused = document.activeElement === input;
      const [start, end] = [input.selectionStart, input.selectionEnd];
      slot.replaceWith(input);
      if (focused) {
        queueMicrotask(() => {
          input.focus(); // the new node is in the document by now
          input.setSelectionRange(start, end);
        });
      }
    }
  }

  // Messages are mutated in place while streaming, so a serialized signature detects changes.
  function renderMessages() {
    const box = els.messages;
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 48;
    const next = new Map();
    let position = 0;
    els.earlier.hidden = !(state.older.length ? state.olderEarlier : state.earlier);
    for (const message of [...state.older, ...state.messages]) {
      if (next.has(message.id)) continue; // a duplicated id would steal its twin's node
      const sig = JSON.stringify(message) + (message === state.messages[state.messages.length - 1] ? "#last" : "");
      let entry = renderCache.get(message.id);
      if (!entry || entry.sig !== sig) {
        const node = renderMessage(message);
        if (entry) keepExpanded(entry.node, node);
        entry = { sig, node };
      }
      next.set(message.id, entry);
      const current = box.children[position];
      if (current !== entry.node) box.insertBefore(entry.node, current || null);
      position++;
    }
    while (box.children.length > position) box.lastElementChild.remove();
    renderCache = next;
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  function renderStatus() {
    const status = currentStatus();
    els.status.dataset.status = status;
    els.status.textContent = statusLabel(status);
    els.recovering.hidden = !state.recovering;
    const id = state.identity;
    els.identity.textContent = id ? `${id.agent || state.agent} / ${id.name || state.name}` : `${state.agent} / ${state.name}`;
    const busy = isBusy();
    els.send.disabled = busy || Boolean(state.fatal) || state.uploading;
    els.stop.hidden = !(activeStream() || state.pendingId);
    els.stopAll.hidden = !somethingQueued();
  }

  function renderRecent() {
    const items = readRecent().map((r) =>
      h(
        "li",
        {},
        h(
          "button",
          {
            type: "button",
            class: "recent-item",
            "data-name": r.name,
            "data-agent": r.agent,
            "aria-current": r.name === state.name && r.agent === state.agent ? "true" : null,
          },
          r.name,
          r.agent && r.agent !== config.defaultAgent ? h("span", { class: "recent-agent" }, r.agent) : null,
        ),
      ),
    );
    els.recent.replaceChildren(...items);
  }

  function render() {
    state.renderQueued = false;
    renderMessages();
    renderStatus();
  }

  function scheduleRender() {
    if (state.renderQueued || !els.messages) return;
    state.renderQueued = true;
    requestAnimationFrame(render);
  }

  // ---------------------------------------------------------------- wiring

  function readJson(id, fallback) {
    const node = document.getElementById(id);
    if (!node) return fallback;
    const value = parseJsonOr(node.textContent, undefined);
    return value === undefined || value === null ? fallback : value;
  }

  function readConfig() {
    const agents = readJson("think-agents", []);
    const list = Array.isArray(agents) ? agents.filter((a) => typeof a === "string") : [];
    const fallback = list[0] || "assistant";
    const defaultAgent = readJson("think-default-agent", fallback);
    return { agents: list.length ? list : [defaultAgent], defaultAgent, mount: readMount() };
  }

  function readMount() {
    // The server renders the URL of this page's view (the mount point); without it, this page's directory.
    const mount = readJson("think-mount", "");
    const path = typeof mount === "string" && mount.startsWith("/") ? mount : location.pathname.replace(/[^/]*$/, "");
    return path.endsWith("/") ? path : `${path}/`;
  }

  function bindElements() {
    const byId = (id) => document.getElementById(id);
    Object.assign(els, {
      openForm: byId("open-form"),
      name: byId("conversation-name"),
      agent: byId("agent-select"),
      recent: byId("recent-list"),
      identity: byId("identity"),
      status: byId("status"),
      recovering: byId("recovering-badge"),
      errorBanner: byId("error-banner"),
      errorText: byId("error-text"),
      errorDismiss: byId("error-dismiss"),
      messages: byId("messages"),
      earlier: byId("earlier-button"),
      composer: byId("composer"),
      input: byId("message-input"),
      send: byId("send-button"),
      stop: byId("stop-button"),
      stopAll: byId("stop-all-button"),
      clear: byId("clear-button"),
      attach: byId("attach-button"),
      fileInput: byId("file-input"),
      attachments: byId("attachments"),
    });
    if (!els.agent.options.length) {
      for (const agent of config.agents) els.agent.append(h("option", { value: agent }, agent));
    }
  }

  function bindEvents() {
    els.openForm.addEventListener("submit", (event) => {
      event.preventDefault();
      openConversation(els.name.value, els.agent.value);
    });
    els.earlier.addEventListener("click", () => loadEarlier());
    els.composer.addEventListener("submit", async (event) => {
      event.preventDefault();
      const text = els.input.value;
      if (await submitMessage(text)) {
        if (els.input.value === text) els.input.value = "";
      }
    });
    els.attach.addEventListener("click", () => els.fileInput.click());
    els.fileInput.addEventListener("change", () => {
      state.attachments.push(...els.fileInput.files);
      els.fileInput.value = "";
      renderAttachments();
    });
    els.attachments.addEventListener("click", (event) => {
      const button = event.target.closest(".attachment-remove");
      if (!button) return;
      state.attachments.splice(Number(button.dataset.index), 1);
      renderAttachments();
    });
    els.input.addEventListener("keydown", (event) => {
      if (event.key !== "Enter" || event.shiftKey || event.isComposing) return;
      event.preventDefault();
      els.composer.requestSubmit();
    });
    els.stop.addEventListener("click", stopTurn);
    els.stopAll.addEventListener("click", stopEverything);
    els.clear.addEventListener("click", clearChat);
    els.errorDismiss.addEventListener("click", hideError);
    els.messages.addEventListener("click", (event) => {
      const branch = event.target.closest(".branch-nav button[data-branch]");
      if (branch) {
        switchBranch(branch.closest(".branch-nav").dataset.anchorId, Number(branch.dataset.branch));
        return;
      }
      if (event.target.closest("button[data-regenerate]")) {
        regenerate();
        return;
      }
      const button = event.target.closest("button[data-action]");
      const box = button && button.closest("[data-tool-call-id]");
      if (box) respondToApproval(box.dataset.toolCallId, button.dataset.action === "approve");
    });
    els.messages.addEventListener("input", (event) => {
      const box = event.target.closest("form[data-action='answer'] input") && event.target.closest("[data-tool-call-id]");
      if (box) state.drafts.set(box.dataset.toolCallId, event.target.value);
    });
    els.messages.addEventListener("submit", (event) => {
      const form = event.target.closest("form[data-action='answer']");
      const box = form && form.closest("[data-tool-call-id]");
      if (!box) return;
      event.preventDefault();
      const part = findToolPart(box.dataset.toolCallId);
      if (part) answerTool(part.toolCallId, toolName(part), { answer: form.elements.answer.value });
    });
    els.recent.addEventListener("click", (event) => {
      const item = event.target.closest("button.recent-item");
      if (item) openConversation(item.dataset.name, item.dataset.agent);
    });
    // Back/forward and hand-edited hashes switch conversations.
    window.addEventListener("hashchange", () => {
      const target = parseHash();
      if (!target) return;
      const agent = target.agent || config.defaultAgent;
      if (target.name !== state.name || agent !== state.agent) openConversation(target.name, agent);
    });
  }

  function init() {
    config = readConfig();
    bindElements();
    bindEvents();
    window.thinkChat = {
      state,
      messages: () => state.messages,
      status: currentStatus,
      socket: () => state.socket,
      open: (name, agent) => openConversation(name, agent || state.agent),
      send: submitText,
    };
    const target = parseHash();
    openConversation(target ? target.name : "", (target && target.agent) || els.agent.value || config.defaultAgent);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
