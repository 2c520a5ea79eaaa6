// The chat page's protocol client under Node (no browser, no server): how UI message chunks fold into
// messages, and how cf_agent_use_chat_response frames (seq, replay, done) and a resume reach the fold.
// Run: node --test tests/js/folding.test.mjs (tests/test_js_folding.py runs it under pytest).
import assert from "node:assert/strict";
import { beforeEach, describe, test } from "node:test";

import { applyChunk, isDuplicate, newStream, parseChunk } from "../../chat/static/chat/client/folding.js";
import { handleFrame } from "../../chat/static/chat/client/frames.js";
import { resetConversation, state, view } from "../../chat/static/chat/client/state.js";

let errors = [];
let renders = 0;

beforeEach(() => {
  resetConversation("folding", "assistant");
  Object.assign(state, { queued: null, probeCount: 0, probeIds: new Map(), ackedIds: new Map(), answered: new Set() });
  errors = [];
  renders = 0;
  view.showError = (text) => errors.push(text);
  view.scheduleRender = () => renders++;
});

// One request's stream, as submitParts registers it before the first frame.
function request(id) {
  state.streams.set(id, newStream(id));
  return state.streams.get(id);
}

function chunks(id, list, extra = {}) {
  for (const chunk of list) {
    handleFrame({ type: "cf_agent_use_chat_response", id, body: JSON.stringify(chunk), done: false, ...extra });
  }
}

function done(id, extra = {}) {
  handleFrame({ type: "cf_agent_use_chat_response", id, body: "", done: true, ...extra });
}

// Frames with seq numbers, as the server sends them.
function numbered(id, list, first = 0, extra = {}) {
  list.forEach((chunk, i) => {
    handleFrame({ type: "cf_agent_use_chat_response", id, body: JSON.stringify(chunk), done: false, seq: first + i, ...extra });
  });
}

const HELLO = [
  { type: "start", messageId: "m1" },
  { type: "start-step" },
  { type: "text-start", id: "t1" },
  { type: "text-delta", id: "t1", delta: "Hel" },
  { type: "text-delta", id: "t1", delta: "lo" },
  { type: "text-end", id: "t1" },
  { type: "finish-step" },
  { type: "finish" },
];

describe("text and reasoning", () => {
  test("text deltas fold into one text part, streaming until text-end", () => {
    request("r1");
    chunks("r1", HELLO.slice(0, 5));
    assert.deepEqual(state.messages, [
      { id: "m1", role: "assistant", parts: [{ type: "step-start" }, { type: "text", text: "Hello", state: "streaming" }] },
    ]);
    chunks("r1", HELLO.slice(5));
    assert.deepEqual(state.messages[0].parts[1], { type: "text", text: "Hello", state: "done" });
    assert.ok(renders > 0);
  });

  test("two text ids are two parts; a delta with no text-start still keeps its text", () => {
    request("r1");
    chunks("r1", [
      { type: "start", messageId: "m1" },
      { type: "text-start", id: "a" },
      { type: "text-delta", id: "a", delta: "one" },
      { type: "text-end", id: "a" },
      { type: "text-delta", id: "b", delta: "two" },
    ]);
    assert.deepEqual(state.messages[0].parts, [
      { type: "text", text: "one", state: "done" },
      { type: "text", text: "two", state: "streaming" },
    ]);
  });

  test("reasoning folds into its own part, apart from the text", () => {
    request("r1");
    chunks("r1", [
      { type: "start", messageId: "m1" },
      { type: "reasoning-start", id: "r" },
      { type: "reasoning-delta", id: "r", delta: "think " },
      { type: "reasoning-delta", id: "r", delta: "hard" },
      { type: "reasoning-end", id: "r" },
      { type: "text-start", id: "t" },
      { type: "text-delta", id: "t", delta: "answer" },
    ]);
    assert.deepEqual(state.messages[0].parts, [
      { type: "reasoning", text: "think hard", state: "done" },
      { type: "text", text: "answer", state: "streaming" },
    ]);
  });

  test("finish-step and the end frame close parts still open", () => {
    request("r1");
    chunks("r1", [
      { type: "start", messageId: "m1" },
      { type: "reasoning-start", id: "r" },
      { type: "reasoning-delta", id: "r", delta: "x" },
      { type: "finish-step" },
      { type: "text-start", id: "t" },
      { type: "text-delta", id: "t", delta: "y" },
    ]);
    assert.equal(state.messages[0].parts[0].state, "done");
    assert.equal(state.messages[0].parts[1].state, "streaming");
    done("r1");
    assert.equal(state.messages[0].parts[1].state, "done");
    assert.equal(state.streams.get("r1").done, true);
  });
});

describe("start, finish and metadata", () => {
  test("start names the message; metadata from start, message-metadata and finish is merged", () => {
    request("r1");
    chunks("r1", [
      { type: "start", messageId: "m1", messageMetadata: { a: 1, model: "x" } },
      { type: "message-metadata", messageMetadata: { b: 2 } },
      { type: "finish", messageMetadata: { a: 3 } },
    ]);
    assert.equal(state.messages.length, 1);
    assert.equal(state.messages[0].id, "m1");
    assert.equal(state.messages[0].role, "assistant");
    assert.deepEqual(state.messages[0].metadata, { a: 3, model: "x", b: 2 });
  });

  test("a stream without a messageId gets a local id from its request id", () => {
    request("r9");
    chunks("r9", [{ type: "text-delta", id: "t", delta: "hi" }]);
    assert.match(state.messages[0].id, /^asst-r9-[A-Za-z0-9_-]{4}$/);
    assert.equal(state.streams.get("r9").messageId, state.messages[0].id);
  });

  test("a second start under one request replaces the abandoned partial in place", () => {
    state.messages.push({ id: "u1", role: "user", parts: [{ type: "text", text: "q" }] });
    request("r1");
    chunks("r1", [
      { type: "start", messageId: "try1" },
      { type: "text-delta", id: "t", delta: "half" },
    ]);
    state.messages.push({ id: "later", role: "user", parts: [] });
    chunks("r1", [
      { type: "start", messageId: "try2" },
      { type: "text-delta", id: "t", delta: "whole" },
    ]);
    assert.deepEqual(
      state.messages.map((m) => m.id),
      ["u1", "try2", "later"],
    );
    assert.deepEqual(state.messages[1].parts, [{ type: "text", text: "whole", state: "streaming" }]);
  });

  test("a start for a message already in the transcript empties and reuses it", () => {
    state.messages.push({ id: "m1", role: "assistant", parts: [{ type: "text", text: "old", state: "done" }] });
    request("r1");
    chunks("r1", [{ type: "start", messageId: "m1" }, { type: "text-delta", id: "t", delta: "new" }]);
    assert.equal(state.messages.length, 1);
    assert.deepEqual(state.messages[0].parts, [{ type: "text", text: "new", state: "streaming" }]);
  });
});

describe("tools", () => {
  test("input streaming, then input available, then output available", () => {
    request("r1");
    chunks("r1", [
      { type: "start", messageId: "m1" },
      { type: "tool-input-start", toolCallId: "c1", toolName: "get_weather" },
    ]);
    const part = state.messages[0].parts[0];
    assert.deepEqual(part, { type: "tool-get_weather", toolCallId: "c1", state: "input-streaming", input: undefined });
    chunks("r1", [{ type: "tool-input-delta", toolCallId: "c1", inputTextDelta: '{"city": "Pa' }]);
    assert.equal(part.input, '{"city": "Pa'); // not JSON yet: the text so far
    chunks("r1", [{ type: "tool-input-delta", toolCallId: "c1", inputTextDelta: 'ris"}' }]);
    assert.deepEqual(part.input, { city: "Paris" });
    chunks("r1", [{ type: "tool-input-available", toolCallId: "c1", toolName: "get_weather", input: { city: "Paris" } }]);
    assert.equal(part.state, "input-available");
    chunks("r1", [{ type: "tool-output-available", toolCallId: "c1", output: { temp: 21 } }]);
    assert.deepEqual(state.messages[0].parts, [
      {
        type: "tool-get_weather",
        toolCallId: "c1",
        state: "output-available",
        input: { city: "Paris" },
        output: { temp: 21 },
        preliminary: undefined,
      },
    ]);
  });

  test("a dynamic tool is a dynamic-tool part with its name", () => {
    request("r1");
    chunks("r1", [
      { type: "start", messageId: "m1" },
      { type: "tool-input-available", toolCallId: "c1", toolName: "lookup", dynamic: true, input: { q: 1 } },
    ]);
    assert.deepEqual(state.messages[0].parts, [
      { type: "dynamic-tool", toolName: "lookup", toolCallId: "c1", state: "input-available", input: { q: 1 } },
    ]);
  });

  test("an approval request marks the call and keeps its approval id", () => {
    request("r1");
    chunks("r1", [
      { type: "start", messageId: "m1" },
      { type: "tool-input-available", toolCallId: "c1", toolName: "send_email", input: { to: "a@b.c" } },
      { type: "tool-approval-request", toolCallId: "c1", approvalId: "ap1" },
    ]);
    const part = state.messages[0].parts[0];
    assert.equal(part.state, "approval-requested");
    assert.deepEqual(part.approval, { id: "ap1" });
    assert.deepEqual(part.input, { to: "a@b.c" });
  });

  test("a continuation folds onto the last assistant message and updates its tool call", () => {
    request("r1");
    chunks("r1", [
      { type: "start", messageId: "m1" },
      { type: "tool-input-available", toolCallId: "c1", toolName: "send_email", input: {} },
      { type: "tool-approval-request", toolCallId: "c1", approvalId: "ap1" },
    ]);
    done("r1");
    request("r2");
    chunks("r2", [{ type: "start", messageId: "other" }], { continuation: true });
    chunks("r2", [
      { type: "tool-output-available", toolCallId: "c1", output: "sent" },
      { type: "text-delta", id: "t", delta: "Done." },
    ]);
    assert.deepEqual(
      state.messages.map((m) => m.id),
      ["m1"],
    );
    assert.equal(state.messages[0].parts[0].state, "output-available");
    assert.equal(state.messages[0].parts[0].output, "sent");
    assert.deepEqual(state.messages[0].parts[1], { type: "text", text: "Done.", state: "streaming" });
    assert.equal(state.streams.get("r2").baseline, 1);
  });

  test("input error, output error and denial", () => {
    request("r1");
    chunks("r1", [
      { type: "start", messageId: "m1" },
      { type: "tool-input-error", toolCallId: "a", toolName: "x", input: "bad", errorText: "invalid input" },
      { type: "tool-input-available", toolCallId: "b", toolName: "y", input: {} },
      { type: "tool-output-error", toolCallId: "b", errorText: "it failed" },
      { type: "tool-input-available", toolCallId: "c", toolName: "z", input: {} },
      { type: "tool-output-denied", toolCallId: "c" },
    ]);
    const [a, b, c] = state.messages[0].parts;
    assert.deepEqual(a, { type: "tool-x", toolCallId: "a", state: "output-error", input: "bad", errorText: "invalid input" });
    assert.deepEqual([b.state, b.errorText], ["output-error", "it failed"]);
    assert.equal(c.state, "output-denied");
  });

  test("an update for an unknown call adds nothing", () => {
    request("r1");
    chunks("r1", [
      { type: "start", messageId: "m1" },
      { type: "tool-output-available", toolCallId: "nobody", output: 1 },
      { type: "tool-approval-request", toolCallId: "nobody", approvalId: "x" },
    ]);
    assert.deepEqual(state.messages[0].parts, []);
  });

  test("get_local_time is answered by the client, but not while a replay goes by", () => {
    request("r1");
    const call = { type: "tool-input-available", toolCallId: "c1", toolName: "get_local_time", input: {} };
    chunks("r1", [{ type: "start", messageId: "m1" }, call], { replay: true });
    assert.deepEqual(state.outbox, []);
    chunks("r1", [call]);
    const [result, probe] = state.outbox;
    assert.equal(result.type, "cf_agent_tool_result");
    assert.equal(result.toolCallId, "c1");
    assert.equal(typeof result.output.iso, "string");
    assert.equal(probe.type, "cf_agent_stream_resume_request");
    assert.equal(state.messages[0].parts[0].state, "output-available");
  });
});

describe("other chunks", () => {
  test("an error chunk is shown and folds nothing", () => {
    request("r1");
    chunks("r1", [{ type: "start", messageId: "m1" }, { type: "error", errorText: "model failed" }]);
    assert.deepEqual(errors, ["model failed"]);
    assert.deepEqual(state.messages[0].parts, []);
  });

  test("an error frame shows its body", () => {
    request("r1");
    handleFrame({ type: "cf_agent_use_chat_response", id: "r1", body: "over quota", error: true, done: true });
    assert.deepEqual(errors, ["over quota"]);
    assert.deepEqual(state.messages, []);
    assert.equal(state.streams.get("r1").done, true);
  });

  test("data parts are replaced by id; transient data is not kept", () => {
    request("r1");
    chunks("r1", [
      { type: "start", messageId: "m1" },
      { type: "data-progress", id: "p", data: { n: 1 } },
      { type: "data-progress", id: "p", data: { n: 2 } },
      { type: "data-note", transient: true, data: "gone" },
      { type: "source-url", sourceId: "s", url: "https://example.com/", title: "Ex" },
      { type: "file", url: "/f/1", mediaType: "image/png" },
    ]);
    assert.deepEqual(state.messages[0].parts, [
      { type: "data-progress", id: "p", data: { n: 2 } },
      { type: "source-url", sourceId: "s", url: "https://example.com/", title: "Ex" },
      { type: "file", url: "/f/1", mediaType: "image/png" },
    ]);
  });

  test("unknown chunk types and bodies that are not chunks are skipped", () => {
    request("r1");
    chunks("r1", [{ type: "start", messageId: "m1" }, { type: "some-future-chunk", x: 1 }]);
    handleFrame({ type: "cf_agent_use_chat_response", id: "r1", body: "No response was generated.", done: false });
    assert.deepEqual(state.messages[0].parts, []);
    assert.equal(parseChunk("[1]"), null);
    assert.equal(parseChunk('{"type": 3}'), null);
    assert.deepEqual(parseChunk('{"type": "finish"}'), { type: "finish" });
  });

  test("applyChunk folds straight into a stream's message", () => {
    const stream = request("r1");
    applyChunk(stream, { type: "start", messageId: "m1" });
    applyChunk(stream, { type: "text-delta", id: "t", delta: "direct" });
    assert.deepEqual(state.messages, [{ id: "m1", role: "assistant", parts: [{ type: "text", text: "direct", state: "streaming" }] }]);
  });
});

describe("seq, replay, done and resume", () => {
  test("a frame whose seq was already applied is dropped", () => {
    request("r1");
    numbered("r1", HELLO.slice(0, 5));
    // The same frames again (a duplicate delivery), then the rest.
    numbered("r1", HELLO.slice(3, 5), 3);
    numbered("r1", HELLO.slice(5), 5);
    assert.equal(state.messages[0].parts[1].text, "Hello");
    assert.equal(state.streams.get("r1").seq, HELLO.length - 1);
  });

  test("isDuplicate: only numbered frames, only at or below the highest seq", () => {
    const stream = newStream("r1");
    assert.equal(isDuplicate(stream, {}), false);
    assert.equal(isDuplicate(stream, { seq: 0 }), false);
    assert.equal(isDuplicate(stream, { seq: 0 }), true);
    assert.equal(isDuplicate(stream, { seq: 2 }), false);
    assert.equal(isDuplicate(stream, { seq: 1 }), true);
    assert.equal(stream.seq, 2);
  });

  test("a resume is ACKed once and its replay rebuilds the message instead of doubling it", () => {
    request("r1");
    numbered("r1", HELLO.slice(0, 4)); // "Hel" shown, then the socket drops
    for (const stream of state.streams.values()) stream.live = false;
    state.probeIds.set("p1", ++state.probeCount);
    handleFrame({ type: "cf_agent_stream_resuming", id: "r1" }); // unprompted, on connect
    handleFrame({ type: "cf_agent_stream_resuming", id: "r1", probeId: "p1" }); // the answer to our probe
    assert.deepEqual(state.outbox, [{ type: "cf_agent_stream_resume_ack", id: "r1" }]);
    const stream = state.streams.get("r1");
    assert.deepEqual([stream.seq, stream.resetOnNext, stream.live], [-1, true, true]);
    // The server replays from chunk 0, then goes on live.
    numbered("r1", HELLO.slice(0, 4), 0, { replay: true });
    numbered("r1", HELLO.slice(4), 4);
    assert.deepEqual(state.messages, [
      { id: "m1", role: "assistant", parts: [{ type: "step-start" }, { type: "text", text: "Hello", state: "done" }] },
    ]);
  });

  test("a replay of a continuation keeps the parts from before it", () => {
    state.messages.push({ id: "m1", role: "assistant", parts: [{ type: "text", text: "before", state: "done" }] });
    request("r2");
    const more = [{ type: "text-start", id: "t" }, { type: "text-delta", id: "t", delta: "after" }];
    numbered("r2", more, 0, { continuation: true });
    handleFrame({ type: "cf_agent_stream_resuming", id: "r2" });
    numbered("r2", more, 0, { continuation: true, replay: true });
    assert.deepEqual(state.messages[0].parts, [
      { type: "text", text: "before", state: "done" },
      { type: "text", text: "after", state: "streaming" },
    ]);
  });

  test("after done, stragglers for the turn are ignored; outcome recovering is kept", () => {
    request("r1");
    numbered("r1", HELLO.slice(0, 4));
    done("r1", { outcome: "recovering" });
    assert.equal(state.recovering, true);
    numbered("r1", [{ type: "text-delta", id: "t1", delta: "late" }], 10);
    assert.deepEqual(state.messages[0].parts, [{ type: "step-start" }, { type: "text", text: "Hel", state: "done" }]);
  });

  test("an idle answer to our probe ends the turns the socket lost; an unprompted one does not", () => {
    request("r1");
    numbered("r1", HELLO.slice(0, 4));
    state.streams.get("r1").live = false;
    handleFrame({ type: "cf_agent_stream_resume_none", reason: "idle" });
    assert.equal(state.streams.get("r1").done, false);
    state.probeIds.set("p1", ++state.probeCount);
    handleFrame({ type: "cf_agent_stream_resume_none", reason: "idle", probeId: "p1" });
    assert.equal(state.streams.get("r1").done, true);
    assert.equal(state.messages[0].parts[1].state, "done");
  });

  test("a bare end frame for a turn never seen adds no stream", () => {
    done("ghost");
    assert.equal(state.streams.has("ghost"), false);
    assert.deepEqual(state.messages, []);
  });
});
