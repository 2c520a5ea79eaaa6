// What the person does, as frames to the server: send, regenerate, stop, clear, answer tools.

import { randomId } from "./util.js";
import { activeStream, clearLocal, findToolPart, hideError, isBusy, scheduleRender, state } from "./state.js";
import { newStream } from "./folding.js";
import { send, sendResumeProbe } from "./socket.js";

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

export function submitText(text) {
  text = (text || "").trim();
  return text ? submitParts([{ type: "text", text }]) : false;
}

export function submitParts(parts) {
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
export function regenerate() {
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
export function switchBranch(anchorId, index) {
  if (isBusy() || state.fatal) return;
  send({ type: "cf_agent_chat_branch", anchorId, index });
}

export function stopTurn() {
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
export function stopEverything() {
  for (const stream of state.streams.values()) if (!stream.done) stream.stopping = true;
  send({ type: "cf_agent_chat_stop" });
  scheduleRender();
}

export function clearChat() {
  send({ type: "cf_agent_chat_clear" });
  clearLocal();
  scheduleRender();
}

// A client tool's answer: the server stores it and continues the turn once every call has one.
export function answerTool(toolCallId, name, output) {
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
export function answerAutomaticTools(chunk) {
  const run = chunk.type === "tool-input-available" && AUTO_TOOLS[chunk.toolName];
  if (run) answerTool(chunk.toolCallId, chunk.toolName, run(chunk.input || {}));
}

export function respondToApproval(toolCallId, approved) {
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
