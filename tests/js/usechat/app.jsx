// A small chat app built the way most AI SDK users build theirs: the PUBLISHED `useChat` from
// @ai-sdk/react with ai@7's own DefaultChatTransport over plain HTTP, `resume: true`, React 19,
// bundled locally by esbuild (tests/e2e/test_usechat.py builds and serves it; no CDN).
//
// The page is opened at /__usechat__/index.html#agent=<kebab name>&name=<chat id> on the server's own
// origin, so the requests carry the session cookie, and the POSTs send Django's CSRF token. It loads
// the stored transcript (get-messages), renders useChat's messages into #messages (what a person sees)
// and exposes the chat's state and actions on window.chat for the test.

import { useEffect, useRef, useState } from "react";
import { createRoot } from "react-dom/client";
import { useChat } from "@ai-sdk/react";
import {
  DefaultChatTransport,
  lastAssistantMessageIsCompleteWithApprovalResponses,
  lastAssistantMessageIsCompleteWithToolCalls,
} from "ai";

const params = new URLSearchParams(window.location.hash.slice(1));
const AGENT = params.get("agent") || "assistant";
const NAME = params.get("name") || "usechat";

function csrfToken() {
  const found = document.cookie.split("; ").find((c) => c.startsWith("csrftoken="));
  return found ? decodeURIComponent(found.slice("csrftoken=".length)) : "";
}

// A client tool the browser answers itself: its schema goes with each request (`clientTools`), so the
// agent's model may call it; useChat's onToolCall answers the call, and the answer is POSTed back.
const CLIENT_TOOLS = [
  { name: "get_local_time", description: "The time on the user's device.", parameters: { type: "object", properties: {} } },
];

// useChat's `resume` asks on mount whether a turn is active (GET .../stream); its status stays "ready"
// while it asks. The test waits for that answer before it sends: a message sent meanwhile would be
// joined by that GET too, and two responses would write one message.
let rejoins = 0;
class Transport extends DefaultChatTransport {
  async reconnectToStream(options) {
    try {
      return await super.reconnectToStream(options);
    } finally {
      rejoins += 1;
    }
  }
}

const transport = new Transport({
  api: `/ai/${AGENT}`,
  headers: () => ({ "X-CSRFToken": csrfToken() }),
  body: { clientTools: CLIENT_TOOLS },
});

const sendAutomaticallyWhen = (options) =>
  lastAssistantMessageIsCompleteWithToolCalls(options) ||
  lastAssistantMessageIsCompleteWithApprovalResponses(options);

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

function Chat({ initial }) {
  const errors = useRef([]);
  const finishes = useRef([]);
  const chatRef = useRef(null);
  const retry = useRef(null);
  // A cut response (the web process died, the network dropped) is rejoined with resumeStream(), as
  // the AI SDK documents; while the server cannot be reached, the rejoin is tried again.
  const rejoinLater = () => {
    clearTimeout(retry.current);
    retry.current = setTimeout(() => chatRef.current && chatRef.current.resumeStream(), 500);
  };
  const chat = useChat({
    id: NAME,
    messages: initial,
    transport,
    resume: true,
    sendAutomaticallyWhen,
    onToolCall: ({ toolCall }) => {
      if (toolCall.toolName === "get_local_time") {
        chatRef.current.addToolOutput({
          tool: "get_local_time",
          toolCallId: toolCall.toolCallId,
          output: { time: "12:34" },
        });
      }
    },
    onError: (error) => {
      const text = String(error && error.message ? error.message : error);
      errors.current.push(text);
      if (/network|failed to fetch|load failed/i.test(text)) rejoinLater();
    },
    onFinish: (event) => {
      finishes.current.push({
        isAbort: event.isAbort,
        isDisconnect: event.isDisconnect,
        isError: event.isError,
        finishReason: event.finishReason || null,
      });
    },
  });
  chatRef.current = chat;
  const [text, setText] = useState("");
  const approve = (id, approved) => chat.addToolApprovalResponse({ id, approved });
  // A durable turn is stopped by the server: aborting the fetch (useChat's stop()) is only a
  // disconnect. The open response then ends as the turn did: its parts closed, an abort, [DONE].
  const stop = () =>
    fetch(`/ai/${AGENT}/${encodeURIComponent(NAME)}/stop`, {
      method: "POST",
      headers: { "X-CSRFToken": csrfToken() },
    });

  useEffect(() => {
    window.chat = {
      ready: true,
      rejoins: () => rejoins,
      status: () => chat.status,
      messages: () => JSON.parse(JSON.stringify(chat.messages)),
      error: () => (chat.error ? String(chat.error.message || chat.error) : null),
      errors: () => errors.current.slice(),
      finishes: () => finishes.current.slice(),
      send: (message) => chat.sendMessage({ text: message }),
      // The files chosen in #files go as the AI SDK sends a FileList: data URLs in the message's parts.
      sendFiles: (message) => chat.sendMessage({ text: message, files: document.getElementById("files").files }),
      regenerate: () => chat.regenerate(),
      edit: (messageId, text) => chat.sendMessage({ text, messageId }),
      stop,
      approve,
      resume: () => chat.resumeStream(),
    };
  });

  return (
    <main>
      <div id="status">{chat.status}</div>
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
        <input id="files" type="file" multiple />
        <button id="send" type="submit">
          Send
        </button>
        <button id="stop" type="button" onClick={stop}>
          Stop
        </button>
      </form>
    </main>
  );
}

function App() {
  const [initial, setInitial] = useState(null);
  useEffect(() => {
    fetch(`/agents/${AGENT}/${encodeURIComponent(NAME)}/get-messages`)
      .then((r) => (r.ok ? r.json() : []))
      .then(setInitial, () => setInitial([]));
  }, []);
  return initial === null ? <div id="loading">loading</div> : <Chat initial={initial} />;
}

createRoot(document.getElementById("root")).render(<App />);
