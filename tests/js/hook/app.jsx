// A small chat app built the way Cloudflare's users build theirs: the PUBLISHED React hook
// (`useAgent` from agents/react, `useAgentChat` from agents/chat/react) with React 19 and ai@7,
// bundled locally by esbuild (tests/e2e/test_react_hook.py builds and serves it; no CDN).
//
// The page is opened at /__hook__/index.html#agent=<kebab name>&name=<conversation> on the server's
// own origin, so get-messages and the socket carry the session cookie like any same-site app.
// It renders the hook's messages into #messages (what a person sees) and exposes the hook's
// state and actions on window.hook for the test.

import { Suspense, useEffect, useRef, useState } from "react";
import { createRoot } from "react-dom/client";
import { useAgent } from "agents/react";
import { useAgentChat } from "agents/chat/react";

const params = new URLSearchParams(window.location.hash.slice(1));
const AGENT = params.get("agent") || "assistant";
const NAME = params.get("name") || "hook";

// A client tool the browser answers itself (the hook sends its schema with each request).
const TOOLS = {
  get_local_time: {
    description: "The time on the user's device.",
    parameters: { type: "object", properties: {} },
    execute: async () => ({ time: "12:34" }),
  },
};

function partText(part) {
  if (part.type === "text" || part.type === "reasoning") return part.text;
  if (part.type === "step-start") return "";
  if (part.type.startsWith("tool-") || part.type === "dynamic-tool") {
    const name = part.type === "dynamic-tool" ? part.toolName : part.type.slice(5);
    const output = part.output === undefined ? "" : ` ${JSON.stringify(part.output)}`;
    return `[${name} ${part.state}${output}]`;
  }
  return `[${part.type}]`;
}

function Message({ message, onApprove }) {
  return (
    <div className="message" data-role={message.role} data-id={message.id}>
      {message.parts.map((part, i) => (
        <span key={i} className="part" data-type={part.type} data-state={part.state || ""}>
          {partText(part)}
          {part.state === "approval-requested" && part.approval ? (
            <>
              <button className="approve" onClick={() => onApprove(part.approval.id, true)}>
                Approve
              </button>
              <button className="reject" onClick={() => onApprove(part.approval.id, false)}>
                Reject
              </button>
            </>
          ) : null}
        </span>
      ))}
    </div>
  );
}

function Chat() {
  const agent = useAgent({ agent: AGENT, name: NAME, host: window.location.host });
  const turnEnds = useRef([]);
  const chat = useAgentChat({
    agent,
    credentials: "include",
    tools: TOOLS,
    onToolCall: async ({ toolCall, addToolOutput }) => {
      const tool = TOOLS[toolCall.toolName];
      if (tool) addToolOutput({ toolCallId: toolCall.toolCallId, output: await tool.execute(toolCall.input) });
    },
    onTurnEnd: (event) => turnEnds.current.push({ ...event, at: Date.now() }),
  });
  const [text, setText] = useState("");
  const approve = (id, approved) => chat.addToolApprovalResponse({ id, approved });

  useEffect(() => {
    window.hook = {
      ready: true,
      status: () => chat.status,
      messages: () => JSON.parse(JSON.stringify(chat.messages)),
      isRecovering: () => Boolean(chat.isRecovering),
      isServerStreaming: () => Boolean(chat.isServerStreaming),
      error: () => (chat.error ? String(chat.error.message || chat.error) : null),
      turnEnds: () => turnEnds.current.slice(),
      send: (message) => chat.sendMessage({ text: message }),
      regenerate: () => chat.regenerate(),
      edit: (messageId, text) => chat.sendMessage({ text, messageId }),
      stop: () => chat.stop(),
      approve,
      clear: () => chat.clearHistory(),
    };
  });

  return (
    <main>
      <div id="status">{chat.status}</div>
      <div id="recovering">{chat.isRecovering ? "recovering" : ""}</div>
      <div id="messages">
        {chat.messages.map((m) => (
          <Message key={m.id} message={m} onApprove={approve} />
        ))}
      </div>
      <form
        onSubmit={(e) => {
          e.preventDefault();
          chat.sendMessage({ text });
          setText("");
        }}
      >
        <input id="input" value={text} onChange={(e) => setText(e.target.value)} />
        <button id="send" type="submit">
          Send
        </button>
        <button id="stop" type="button" onClick={() => chat.stop()}>
          Stop
        </button>
      </form>
    </main>
  );
}

createRoot(document.getElementById("root")).render(
  <Suspense fallback={<div id="loading">loading</div>}>
    <Chat />
  </Suspense>,
);
