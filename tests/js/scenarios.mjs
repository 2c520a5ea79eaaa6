// Drives a live thinkproject server with the PUBLISHED client packages: `AgentClient` (agents/client),
// `WebSocketChatTransport` (agents/chat/transport) and `readUIMessageStream` (ai), the way the
// `useAgentChat` hook wires them (its shared onmessage routes the resume frames to the transport).
//
//   node scenarios.mjs <host:port> <agent> <conversation name> <scenario> [options json]
//
// Prints exactly ONE JSON line on stdout with what it observed (`ok: false` and `error` on failure, exit
// code 1); progress events for the test that drives it go to stderr as JSON lines ("progress" key).
// Every wait is bounded; the whole run is bounded by options.timeoutMs.

import WS from "ws";
import { AgentClient } from "agents/client";
import { WebSocketChatTransport } from "agents/chat/transport";
import { readUIMessageStream } from "ai";

const [host, agent, name, scenario, optionsJson = "{}"] = process.argv.slice(2);
const options = JSON.parse(optionsJson);
const T0 = performance.now();
const now = () => Math.round(performance.now() - T0);
const tabs = [];

let finished = false;

function finish(result, code = 0) {
  if (finished) return;
  finished = true;
  for (const tab of tabs) {
    try {
      tab.client.close();
    } catch {}
  }
  const line = JSON.stringify({ scenario, ms: now(), ...result, tabs: tabs.map((tab) => tab.report()) });
  process.stdout.write(`${line}\n`, () => process.exit(code));
}

function fail(error) {
  finish({ ok: false, error: String(error?.stack ?? error) }, 1);
}

setTimeout(() => fail(new Error(`scenario timed out after ${options.timeoutMs ?? 45000} ms`)), options.timeoutMs ?? 45000);

process.on("uncaughtException", fail);
process.on("unhandledRejection", fail);

function progress(event, data = {}) {
  process.stderr.write(`${JSON.stringify({ progress: event, t: now(), ...data })}\n`);
}

function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** A frame as reported to pytest: chat response bodies parsed, everything else as received. */
function compact(frame) {
  if (frame.type !== "cf_agent_use_chat_response") return frame;
  let chunk = null;
  if (frame.body && !frame.error) {
    try {
      chunk = JSON.parse(frame.body);
    } catch {}
  }
  return { ...frame, body: chunk ?? frame.body };
}

/** One browser tab: an AgentClient, its transport, and the hook's routing of the resume frames. */
class Tab {
  constructor(label) {
    this.label = label;
    this.generation = 0; // bumped on every socket open: frames are tagged with the connection they came on
    this.received = [];
    this.sent = [];
    this.waiters = new Set();
    // The server wants credentials (chat.access); a Node client has no session cookie, so a token.
    const query = options.token ? { token: options.token } : undefined;
    this.client = new AgentClient({ agent, name, host, WebSocket: WS, query });
    this.transport = new WebSocketChatTransport({ agent: this.client });
    const send = this.client.send.bind(this.client);
    this.client.send = (data) => {
      try {
        this.sent.push({ t: now(), gen: this.generation, ...JSON.parse(data) });
      } catch {}
      return send(data);
    };
    this.client.addEventListener("open", () => {
      this.generation += 1;
    });
    this.client.addEventListener("message", (event) => {
      let data;
      try {
        data = JSON.parse(event.data);
      } catch {
        return;
      }
      const entry = { t: now(), gen: this.generation, ...data };
      this.received.push(entry);
      // What useAgentChat's shared onmessage does for these three (its react.tsx, in the published agents package).
      if (data.type === "cf_agent_stream_resuming") this.transport.handleStreamResuming(data);
      else if (data.type === "cf_agent_stream_resume_none") this.transport.handleStreamResumeNone(data);
      else if (data.type === "cf_agent_stream_pending") this.transport.handleStreamPending();
      for (const waiter of [...this.waiters]) waiter(entry);
    });
    tabs.push(this);
  }

  /** The first frame (already received since index `from`, or still to come) that matches. */
  waitFrame(predicate, what, ms = 15000, from = 0) {
    const seen = this.received.slice(from).find(predicate);
    if (seen) return Promise.resolve(seen);
    let waiter;
    const arrived = new Promise((resolve) => {
      waiter = (frame) => {
        if (predicate(frame)) resolve(frame);
      };
      this.waiters.add(waiter);
    });
    return withTimeout(arrived, ms, `${this.label}: ${what}`).finally(() => this.waiters.delete(waiter));
  }

  waitEvent(type, ms = 10000) {
    return withTimeout(
      new Promise((resolve) => this.client.addEventListener(type, resolve, { once: true })),
      ms,
      `${this.label}: socket ${type}`,
    );
  }

  send(frame) {
    this.client.send(JSON.stringify(frame));
  }

  report() {
    return { label: this.label, id: this.client.id, received: this.received.map(compact), sent: this.sent };
  }
}

function userMessage(text) {
  return { id: `u-${Math.random().toString(36).slice(2, 10)}`, role: "user", parts: [{ type: "text", text }] };
}

function textOf(message) {
  return (message?.parts ?? []).filter((p) => p.type === "text").map((p) => p.text).join("");
}

/**
 * Folds a UI chunk stream with ai's readUIMessageStream. `onChunk(chunk, chunks)` sees every chunk as it
 * passes (to act mid-stream). Returns the last message snapshot, its text, the chunk types and the errors.
 */
async function fold(stream, { message, onChunk, ms = 30000, what = "the stream to end" } = {}) {
  const chunks = [];
  const errors = [];
  let last = message;
  let firstChunkAt = null;
  const tapped = stream.pipeThrough(
    new TransformStream({
      transform(chunk, controller) {
        firstChunkAt ??= now();
        chunks.push(chunk);
        controller.enqueue(chunk);
        onChunk?.(chunk, chunks);
      },
    }),
  );
  const folding = (async () => {
    for await (const snapshot of readUIMessageStream({
      stream: tapped,
      message,
      onError: (error) => errors.push(String(error?.message ?? error)),
    })) {
      last = snapshot;
    }
  })();
  await withTimeout(folding, ms, what);
  return {
    message: last,
    text: textOf(last),
    chunkTypes: chunks.map((c) => c.type),
    errors,
    firstChunkAt,
    endedAt: now(),
  };
}

const textDeltas = (chunks) => chunks.filter((c) => c.type === "text-delta").length;

/** The response frames of one request a tab received (optionally on one connection). */
function responseFrames(tab, requestId, gen) {
  return tab.received.filter(
    (f) => f.type === "cf_agent_use_chat_response" && f.id === requestId && (gen === undefined || f.gen === gen),
  );
}

function doneFrame(requestId) {
  return (f) => f.type === "cf_agent_use_chat_response" && f.id === requestId && f.done === true;
}

async function openTab(label) {
  const tab = new Tab(label);
  await withTimeout(tab.client.ready, 10000, `${label}: ready (cf_agent_identity)`);
  return tab;
}

/** A readable stream of the UI chunks one request's frames carry, as another tab observes them. */
function observedStream(tab, requestId) {
  let waiter = null;
  return new ReadableStream({
    start(controller) {
      const push = (frame) => {
        if (frame.type !== "cf_agent_use_chat_response" || frame.id !== requestId) return false;
        if (frame.body && !frame.error) controller.enqueue(JSON.parse(frame.body));
        if (frame.done || frame.error) {
          controller.close();
          return true;
        }
        return false;
      };
      for (const frame of tab.received) if (push(frame)) return;
      waiter = (frame) => {
        if (push(frame)) tab.waiters.delete(waiter);
      };
      tab.waiters.add(waiter);
    },
    cancel() {
      tab.waiters.delete(waiter); // the reader gave up (a chunk it could not apply)
    },
  });
}

function withPart(message, toolCallId, changes) {
  return { ...message, parts: message.parts.map((p) => (p.toolCallId === toolCallId ? { ...p, ...changes } : p)) };
}

/**
 * After a tool answer: what useAgentChat does after a tool result (docs/protocol.md), expectToolContinuation() then
 * reconnectToStream(), and the continuation folded onto `message`. When that stream ends without a chunk
 * (the probe was answered cf_agent_stream_resume_none), the hook shows the continuation through its
 * observer path instead: its live frames on the socket; `via` says which path it came through.
 */
async function followToolContinuation(tab, requestId, from, message) {
  tab.transport.expectToolContinuation();
  const stream = await withTimeout(tab.transport.reconnectToStream({ chatId: name }), 10000, "the continuation stream");
  if (stream === null) throw new Error("reconnectToStream returned no continuation stream");
  let second = await fold(stream, { message, what: "the continuation stream to end" });
  let via = "transport";
  let continuationId = tab.sent.findLast((f) => f.type === "cf_agent_stream_resume_ack")?.id;
  if (second.chunkTypes.length === 0) {
    via = "observer";
    const live = await tab.waitFrame(
      (f) => f.type === "cf_agent_use_chat_response" && f.continuation === true && f.id !== requestId,
      "a continuation frame on the socket",
      10000,
      from,
    );
    continuationId = live.id;
    second = await fold(observedStream(tab, continuationId), { message, what: "the observed continuation" });
  }
  // The fold may stop early (on a chunk it cannot apply); the frames still come until the server's done.
  const done = await tab.waitFrame(doneFrame(continuationId), "the continuation's done frame", 10000);
  const updated = await tab.waitFrame((f) => f.type === "cf_agent_message_updated", "cf_agent_message_updated", 5000, from);
  // The transcript the server sends after the continuation's done frame: the continued message, whole.
  const messages = await tab.waitFrame(
    (f) => f.type === "cf_agent_chat_messages",
    "the transcript after the continuation",
    5000,
    tab.received.indexOf(done) + 1,
  );
  return { continuationId, via, second, updated: updated.message, broadcast: messages.messages };
}

const scenarios = {
  // (a) ready resolves on cf_agent_identity; an idle resume probe resolves null at once.
  async connect() {
    const t = now();
    const tab = await openTab("tab");
    const readyMs = now() - t;
    const identity = { name: tab.client.name, agent: tab.client.agent, identified: tab.client.identified };
    const probeStart = now();
    const resumed = await withTimeout(tab.transport.reconnectToStream({ chatId: name }), 10000, "idle probe");
    return { readyMs, identity, probe: { isNull: resumed === null, ms: now() - probeStart } };
  },

  // (b) one streamed turn, folded.
  async turn() {
    const tab = await openTab("tab");
    const user = userMessage(options.prompt ?? "count to 30");
    const stream = await tab.transport.sendMessages({
      chatId: name,
      messages: [user],
      trigger: "submit-message",
      abortSignal: undefined,
    });
    const requestId = tab.transport.activeServerTurnId;
    const folded = await fold(stream);
    // The transcript broadcast that follows the turn.
    const messages = await tab.waitFrame(
      (f) => f.type === "cf_agent_chat_messages" && f.messages.some((m) => m.id === folded.message?.id),
      "cf_agent_chat_messages with the assistant message",
      5000,
    );
    return { requestId, userId: user.id, folded, broadcast: messages.messages };
  },

  // (c) the socket is dropped mid-stream and the turn is resumed with reconnectToStream.
  async resume() {
    const tab = await openTab("tab");
    const dropAfter = options.dropAfter ?? 10;
    const stream = await tab.transport.sendMessages({
      chatId: name,
      messages: [userMessage(options.prompt ?? "count to 80 [rate 40]")],
      trigger: "submit-message",
      abortSignal: undefined,
    });
    const requestId = tab.transport.activeServerTurnId;
    let dropped = false;
    const opened = tab.waitEvent("open", 20000);
    opened.catch(() => {});
    const first = await fold(stream, {
      onChunk: (chunk, chunks) => {
        if (!dropped && textDeltas(chunks) >= dropAfter) {
          dropped = true;
          progress("drop");
          tab.client.reconnect();
        }
      },
    });
    if (!dropped) throw new Error("the turn ended before the socket was dropped");
    await opened;
    const probeStart = now();
    const resumed = await withTimeout(tab.transport.reconnectToStream({ chatId: name }), 10000, "resume probe");
    if (resumed === null) throw new Error("the resume probe found nothing to resume");
    const probeMs = now() - probeStart;
    const second = await fold(resumed);
    return { requestId, first, second, probeMs, activeAfter: tab.transport.activeServerTurnId };
  },

  // (d) cancelActiveServerTurn after a few chunks of a slow count.
  async cancel() {
    const tab = await openTab("tab");
    const cancelAfter = options.cancelAfter ?? 5;
    const stream = await tab.transport.sendMessages({
      chatId: name,
      messages: [userMessage(options.prompt ?? "count to 300 [rate 30]")],
      trigger: "submit-message",
      abortSignal: undefined,
    });
    const requestId = tab.transport.activeServerTurnId;
    let cancelled = null;
    const folded = await fold(stream, {
      onChunk: (chunk, chunks) => {
        if (cancelled === null && textDeltas(chunks) >= cancelAfter) {
          cancelled = tab.transport.cancelActiveServerTurn();
          progress("cancel", { cancelled });
        }
      },
    });
    const streamEndedAt = now();
    const done = await tab.waitFrame(doneFrame(requestId), "the server's done frame", 10000);
    const messages = await tab.waitFrame(
      (f) => f.type === "cf_agent_chat_messages" && f.messages.some((m) => m.id === folded.message?.id),
      "cf_agent_chat_messages with the partial",
      5000,
    );
    return {
      requestId,
      cancelled,
      folded,
      streamEndedAt,
      activeAfter: tab.transport.activeServerTurnId,
      done: compact(done),
      broadcast: messages.messages,
    };
  },

  // (e) a client tool: the client answers with cf_agent_tool_result and follows the continuation.
  async clientTool() {
    const tab = await openTab("tab");
    const clientTools = options.clientTools;
    const stream = await tab.transport.sendMessages({
      chatId: name,
      messages: [userMessage(options.prompt)],
      trigger: "submit-message",
      abortSignal: undefined,
      body: { clientTools },
    });
    const requestId = tab.transport.activeServerTurnId;
    const first = await fold(stream);
    const part = first.message.parts.find((p) => p.type === `tool-${options.tool}`);
    if (!part || part.state !== "input-available") throw new Error(`no input-available tool part: ${JSON.stringify(first.message)}`);
    const from = tab.received.length;
    tab.send({
      type: "cf_agent_tool_result",
      toolCallId: part.toolCallId,
      toolName: options.tool,
      output: options.output,
      autoContinue: true,
      clientTools,
    });
    // The hook's addToolOutput applies the result locally.
    const answered = withPart(first.message, part.toolCallId, { state: "output-available", output: options.output });
    return { requestId, toolPart: part, first, ...(await followToolContinuation(tab, requestId, from, answered)) };
  },

  // (f) a tool that needs approval: approval.id -> toolCallId, cf_agent_tool_approval, the continuation.
  async approval() {
    const tab = await openTab("tab");
    const stream = await tab.transport.sendMessages({
      chatId: name,
      messages: [userMessage(options.prompt)],
      trigger: "submit-message",
      abortSignal: undefined,
    });
    const requestId = tab.transport.activeServerTurnId;
    const first = await fold(stream);
    const requested = first.message.parts.find((p) => p.state === "approval-requested");
    if (!requested?.approval?.id) throw new Error(`no approval-requested part: ${JSON.stringify(first.message)}`);
    // addToolApprovalResponse({id: approval.id}) finds the call by its approval id, as the hook does.
    const part = first.message.parts.find((p) => p.approval?.id === requested.approval.id);
    const from = tab.received.length;
    tab.send({ type: "cf_agent_tool_approval", toolCallId: part.toolCallId, approved: true, autoContinue: true });
    const responded = withPart(first.message, part.toolCallId, {
      state: "approval-responded",
      approval: { ...part.approval, approved: true },
    });
    return { requestId, toolPart: part, first, ...(await followToolContinuation(tab, requestId, from, responded)) };
  },

  // (g) a second tab on the same conversation observes the first tab's turn.
  async secondTab() {
    const tab1 = await openTab("tab1");
    const tab2 = await openTab("tab2");
    const from = tab2.received.length;
    const user = userMessage(options.prompt ?? "count to 20");
    const stream = await tab1.transport.sendMessages({
      chatId: name,
      messages: [user],
      trigger: "submit-message",
      abortSignal: undefined,
    });
    const requestId = tab1.transport.activeServerTurnId;
    const [own, observed] = await Promise.all([fold(stream), fold(observedStream(tab2, requestId))]);
    const pushed = await tab2.waitFrame(
      (f) => f.type === "cf_agent_chat_messages" && f.messages.some((m) => m.id === user.id),
      "the user message pushed to tab2",
      5000,
      from,
    );
    return { requestId, userId: user.id, own, observed, pushed: compact(pushed) };
  },

  // (h) the worker is SIGKILLed mid-stream (by the test, on the "kill" progress event) while the client
  // watches; the client follows the recovery and picks the continuation up with a new resume probe.
  async recovery() {
    const tab = await openTab("tab");
    const killAfter = options.killAfter ?? 12;
    const stream = await tab.transport.sendMessages({
      chatId: name,
      messages: [userMessage(options.prompt ?? "count to 60 [rate 25]")],
      trigger: "submit-message",
      abortSignal: undefined,
    });
    const requestId = tab.transport.activeServerTurnId;
    let asked = false;
    const first = await fold(stream, {
      ms: 40000,
      what: "the interrupted stream to end",
      onChunk: (chunk, chunks) => {
        if (!asked && textDeltas(chunks) >= killAfter) {
          asked = true;
          progress("kill");
        }
      },
    });
    const firstDone = responseFrames(tab, requestId).find((f) => f.done) ?? null;
    await tab.waitFrame((f) => f.type === "cf_agent_chat_recovering" && f.recovering === true, "recovering: true", 20000);
    // Probe until the continuation is there (the hook probes on status changes; a probe that meets the
    // pre-stream window gets cf_agent_stream_pending and waits).
    const probes = [];
    let continuation = null;
    const deadline = Date.now() + 30000;
    while (continuation === null && Date.now() < deadline) {
      const probeStart = now();
      continuation = await withTimeout(tab.transport.reconnectToStream({ chatId: name }), 65000, "a resume probe");
      probes.push({ t: probeStart, ms: now() - probeStart, found: continuation !== null });
      if (continuation === null) await sleep(200);
    }
    if (continuation === null) throw new Error("no resume probe found the continuation");
    const second = await fold(continuation, { ms: 40000, what: "the continuation stream to end" });
    await tab.waitFrame((f) => f.type === "cf_agent_chat_recovering" && f.recovering === false, "recovering: false", 10000);
    return { requestId, first, firstDone: firstDone && compact(firstDone), probes, second };
  },
};

const run = scenarios[scenario];
if (!run) {
  fail(new Error(`unknown scenario ${scenario}; known: ${Object.keys(scenarios).join(", ")}`));
} else {
  run().then((result) => finish({ ok: true, ...result }), fail);
}
