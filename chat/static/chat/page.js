// The chat page: DOM rendering and event handlers over the protocol client (./client/).
// Model output is only ever written with textContent.

import { parseJsonOr, randomName } from "./client/util.js";
import {
  activeStream,
  config,
  currentStatus,
  findToolPart,
  isBusy,
  isToolPart,
  resetConversation,
  somethingQueued,
  state,
  toolName,
  view,
} from "./client/state.js";
import { closeSocket, connect, loadEarlier, loadTranscript } from "./client/socket.js";
import {
  answerTool,
  clearChat,
  regenerate,
  respondToApproval,
  stopEverything,
  stopTurn,
  submitParts,
  submitText,
  switchBranch,
} from "./client/actions.js";

const RECENT_KEY = "thinkChat.recent";
const RECENT_MAX = 10;

const els = {};
let renderCache = new Map(); // message id -> {sig, node}

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
  resetView(name, agent);
  const conversation = state.conversation;
  if (location.hash !== hashFor(name, agent)) location.hash = hashFor(name, agent);
  rememberRecent(name, agent); // also re-renders the recent list, which changes only here
  render();
  // Transcript first, then the socket, so replayed frames fold onto the loaded history.
  await loadTranscript(conversation);
  if (conversation === state.conversation) connect();
}

function resetView(name, agent) {
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

// ---------------------------------------------------------------- status

function queuedLabel(id) {
  const queued = state.queued;
  if (!queued || queued.id !== id) return null;
  const ahead = Number.isInteger(queued.position) && queued.position > 0 ? ` (${queued.position} ahead)` : "";
  return queued.reason === "workers" ? "queued: waiting for a worker…" : `queued${ahead}…`;
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

export function init() {
  Object.assign(config, readConfig());
  Object.assign(view, { scheduleRender, showError, hideError });
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
