/*
 * Think chat page: a dependency-free browser client for the Cloudflare Agents
 * `cf_agent_*` chat protocol (docs/protocol.md).
 *
 * It mirrors what the published `agents` client does (PartySocket reconnects,
 * the resume handshake, AI SDK chunk folding) in plain JavaScript ES modules, so
 * the page needs no build step: client/ is the protocol client (state, chunk
 * folding, frames, the socket; no DOM), page.js renders it and handles events.
 * Model output is only ever written with textContent.
 */
import { init } from "./page.js";

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
else init();
