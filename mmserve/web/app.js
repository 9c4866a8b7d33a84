// The chat page: conversations, sending and stopping, and the wiring of the page's controls.
//
// A conversation is {id, title, updated_at, messages}; a message is {role: "user", text, images}
// (images: [{url, name, fileId}], uploads.js) or {role: "assistant", text, stats?, error?,
// stopped?}. Memory is the source of truth; IndexedDB (store.js) is written after each change,
// and a failed write only shows a notice.

import { streamAnswer } from "./answer.js";
import { listModels } from "./api.js";
import { createComposer } from "./composer.js";
import {
  bindSettingsForm,
  bindThemeToggle,
  changeSetting,
  loadSettings,
  samplingSummary,
  showModels,
} from "./settings.js";
import * as store from "./store.js";
import { forgetImages, uploadImage } from "./uploads.js";
import {
  editMessage,
  editTitle,
  renderConversationList,
  renderThread,
  updateStreamingAnswer,
} from "./view.js";

const NEW_TITLE = "New chat";
const CURRENT_KEY = "mmserve.current";

const $ = (id) => document.getElementById(id);
const state = {
  conversations: [], // newest first; `messages` is null until the conversation is first opened
  current: null,
  streaming: null, // {conversation, message, controller} while an answer is generated
  settings: loadSettings(),
  composer: null,
  authNotice: false, // the notice shown is about the API key (it goes once a key works)
};

// ----------------------------------------------------------------------------- notices

function showNotice(text, { auth = false } = {}) {
  $("notice-text").textContent = text;
  $("notice").hidden = false;
  state.authNotice = auth;
}

const AUTH_HINT = "This server needs an API key: enter it in Settings (⚙, top right).";

function announce(text) {
  $("status").textContent = text;
}

function storageFailed(error) {
  if (error?.name === "QuotaExceededError") {
    showNotice(
      "Browser storage is full, so this conversation was not saved. " +
        "Delete old conversations (images take the most room) to make space.",
    );
  } else {
    showNotice(
      `Conversations could not be saved here (${error?.message ?? error}); they will be lost on reload.`,
    );
  }
}

// ----------------------------------------------------------------------------- conversations

// Not crypto.randomUUID(): that exists only in secure contexts, and the page may be served over
// plain http on a LAN address.
function newConversation() {
  const id = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
  return { id, title: NEW_TITLE, updated_at: Date.now(), messages: [] };
}

async function save(conversation) {
  if (conversation.deleted) return; // an answer that was streaming when its conversation went
  conversation.updated_at = Date.now();
  if (!state.conversations.includes(conversation)) state.conversations.unshift(conversation);
  state.conversations.sort((a, b) => b.updated_at - a.updated_at);
  showSidebar();
  try {
    // A copy of the list: the write happens later, after a new answer may have been appended.
    await store.saveConversation({ ...conversation, messages: [...conversation.messages] });
  } catch (error) {
    storageFailed(error);
  }
}

async function open(conversation) {
  if (conversation.messages === null) {
    try {
      conversation.messages = await store.loadMessages(conversation.id);
    } catch (error) {
      storageFailed(error);
      conversation.messages = [];
    }
  }
  state.current = conversation;
  localStorage.setItem(CURRENT_KEY, conversation.id);
  setSidebarOpen(false);
  showSidebar();
  showThread();
}

async function rename(conversation, item) {
  const title = await editTitle(item, conversation.title);
  if (title !== null && title !== conversation.title) {
    conversation.title = title;
    try {
      await store.saveTitle(conversation);
    } catch (error) {
      storageFailed(error);
    }
  }
  showSidebar();
  if (conversation === state.current) $("chat-title").textContent = title ?? conversation.title;
}

async function remove(conversation) {
  if (!confirm(`Delete “${conversation.title}”?`)) return;
  conversation.deleted = true;
  if (state.streaming?.conversation === conversation) state.streaming.controller.abort();
  state.conversations = state.conversations.filter((c) => c !== conversation);
  // Its uploaded images go too (a conversation never opened since the reload is read first).
  const messages = conversation.messages ?? (await store.loadMessages(conversation.id).catch(() => []));
  forgetImages(imagesOf(messages), { apiKey: state.settings.api_key });
  try {
    await store.deleteConversation(conversation.id);
  } catch (error) {
    storageFailed(error);
  }
  if (conversation === state.current) await open(state.conversations[0] ?? newConversation());
  else showSidebar();
}

function imagesOf(messages) {
  return messages.flatMap((message) => (message.role === "user" ? message.images : []));
}

function titleFrom(text, images) {
  const words = text.trim().replace(/\s+/g, " ");
  if (!words) return images.length > 1 ? `${images.length} images` : "Image";
  return words.length > 40 ? `${words.slice(0, 40)}…` : words;
}

// ----------------------------------------------------------------------------- generating

/** Append an answer to the conversation and stream it in. Resolves when it ends, however. */
async function generate(conversation) {
  const history = [...conversation.messages];
  const message = { role: "assistant", text: "" };
  conversation.messages.push(message);
  const controller = new AbortController();
  state.streaming = { conversation, message, controller };
  setBusy(true);
  showThread();
  announce("Generating an answer…");

  let frame = 0;
  const onText = () => {
    // Chunks come faster than frames; draw at most once a frame.
    frame ||= requestAnimationFrame(() => {
      frame = 0;
      if (state.current === conversation && state.streaming?.message === message) {
        updateStreamingAnswer($("thread"), message);
        followBottom();
      }
    });
  };
  await streamAnswer(message, history, state.settings, { signal: controller.signal, onText });

  announce(message.error ? `Error: ${message.error}` : message.stopped ? "Stopped." : "Answer complete.");
  state.streaming = null;
  setBusy(false);
  if (state.current === conversation) showThread();
  await save(conversation);
}

function send({ text, images }) {
  if (state.streaming) return false;
  const conversation = state.current;
  if (!conversation.messages.length) conversation.title = titleFrom(text, images);
  conversation.messages.push({ role: "user", text, images });
  save(conversation); // the question is kept even if the page closes mid-answer
  generate(conversation);
  return true;
}

function regenerate() {
  const conversation = state.current;
  if (state.streaming || conversation.messages.at(-1)?.role !== "assistant") return;
  conversation.messages.pop();
  generate(conversation);
}

function resend(index, text) {
  const conversation = state.current;
  if (state.streaming) return;
  const message = conversation.messages[index];
  conversation.messages = [...conversation.messages.slice(0, index), { ...message, text }];
  generate(conversation);
}

async function copy(index, button) {
  try {
    await navigator.clipboard.writeText(state.current.messages[index].text);
    button.textContent = "Copied";
    setTimeout(() => (button.textContent = "Copy"), 1500);
  } catch (error) {
    showNotice(`Could not copy (the clipboard needs https or localhost): ${error.message}`);
  }
}

// ----------------------------------------------------------------------------- drawing

function showSidebar() {
  renderConversationList($("conversation-list"), state.conversations, state.current?.id);
}

function showThread() {
  $("chat-title").textContent = state.current.title;
  renderThread($("thread"), state.current.messages, state.streaming?.message ?? null);
  followBottom(true);
}

// Keep the newest text in view, unless the user has scrolled up to read.
function followBottom(force = false) {
  const thread = $("thread");
  if (force || thread.scrollHeight - thread.scrollTop - thread.clientHeight < 120) {
    thread.scrollTop = thread.scrollHeight;
  }
}

function setSidebarOpen(opened) {
  document.body.classList.toggle("sidebar-open", opened);
  $("toggle-sidebar").setAttribute("aria-expanded", String(opened));
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  if (!busy && document.activeElement === document.body) $("prompt").focus();
}

async function refreshModels() {
  try {
    showModels(
      $("settings-form").elements.model,
      await listModels({ apiKey: state.settings.api_key }),
      state.settings,
    );
    $("model-name").textContent = state.settings.model;
    if (state.authNotice) $("notice").hidden = true;
  } catch (error) {
    $("model-name").textContent = "";
    const auth = error.status === 401;
    showNotice(`Could not list the models: ${error.message}.${auth ? ` ${AUTH_HINT}` : ""}`, { auth });
  }
}

function showSampling() {
  const temperature = state.settings.temperature.trim();
  $("greedy").checked = temperature !== "" && Number(temperature) === 0;
  $("sampling-summary").textContent = samplingSummary(state.settings);
}

/** A sample question: attach its picture (fetched like a file) and send the question. */
async function askSample(button) {
  const response = await fetch(`static/samples/${button.dataset.sample}`);
  const file = new File([await response.blob()], button.dataset.sample, { type: "image/png" });
  await state.composer.addFiles([file]);
  $("prompt").value = button.dataset.question;
  state.composer.submit();
}

// ----------------------------------------------------------------------------- wiring

function wire() {
  $("new-chat").onclick = () => open(newConversation()).then(() => $("prompt").focus());
  $("stop").onclick = () => state.streaming?.controller.abort();
  $("notice-close").onclick = () => ($("notice").hidden = true);
  $("open-settings").onclick = () => $("settings").showModal();
  $("toggle-sidebar").onclick = () => {
    setSidebarOpen(true);
    $("new-chat").focus();
  };
  $("close-sidebar").onclick = () => {
    setSidebarOpen(false);
    $("toggle-sidebar").focus();
  };
  addEventListener("keydown", (event) => {
    if (event.key === "Escape" && document.body.classList.contains("sidebar-open"))
      $("close-sidebar").click();
  });
  document.body.addEventListener("click", (event) => {
    if (event.target === document.body) setSidebarOpen(false);
  });
  bindSettingsForm($("settings-form"), state.settings, (name) => {
    if (name === "model") $("model-name").textContent = state.settings.model;
    showSampling();
  });
  $("greedy").onchange = () => {
    changeSetting($("settings-form"), state.settings, "temperature", $("greedy").checked ? "0" : "");
    showSampling();
  };
  showSampling();
  // On "change" (leaving the field), not on each keystroke: a half-typed key would be refused.
  $("settings-form").elements.api_key.addEventListener("change", refreshModels);
  state.composer = createComposer({
    form: $("composer"),
    textarea: $("prompt"),
    fileInput: $("file-input"),
    attachButton: $("attach"),
    list: $("attachments"),
    dropZone: document.body,
    upload: (image) => uploadImage(image, { apiKey: state.settings.api_key }),
    onDiscard: (image) => forgetImages([image], { apiKey: state.settings.api_key }),
    onSend: send,
    onNotice: showNotice,
  });

  $("conversation-list").onclick = (event) => {
    const button = event.target.closest("[data-action]");
    if (!button) return;
    const item = button.closest("[data-id]");
    const conversation = state.conversations.find((c) => c.id === item.dataset.id);
    if (button.dataset.action === "open") open(conversation);
    if (button.dataset.action === "rename") rename(conversation, item);
    if (button.dataset.action === "delete") remove(conversation);
  };
  $("thread").onclick = (event) => {
    const sample = event.target.closest("[data-sample]");
    if (sample) return askSample(sample);
    const button = event.target.closest("[data-action]");
    if (!button) return;
    const index = Number(button.closest("[data-index]").dataset.index);
    if (button.dataset.action === "copy") copy(index, button);
    if (button.dataset.action === "regenerate") regenerate();
    if (button.dataset.action === "edit") {
      editMessage(button.closest("article"), state.current.messages[index].text, (text) =>
        resend(index, text),
      );
    }
  };
}

async function start() {
  // Whatever breaks later, say so on the page rather than leave it dead or blank.
  addEventListener("error", (event) => showNotice(`Something went wrong: ${event.message}`));
  addEventListener("unhandledrejection", (event) => showNotice(`Something went wrong: ${event.reason}`));
  bindThemeToggle($("theme-toggle")); // first, so a saved theme shows before anything else
  try {
    state.conversations = (await store.listConversations()).map((c) => ({ ...c, messages: null }));
  } catch (error) {
    storageFailed(error);
  }
  const saved = state.conversations.find((c) => c.id === localStorage.getItem(CURRENT_KEY));
  await open(saved ?? newConversation());
  wire(); // after a conversation is open: the controls act on it
  refreshModels();
}

start();
