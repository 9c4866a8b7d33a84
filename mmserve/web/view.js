// DOM for the sidebar and the thread. Builds elements from state; app.js owns the state and
// handles the clicks (buttons carry data-action, messages data-index).

import { renderMarkdown } from "./markdown.js";

function element(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key.startsWith("aria-") || key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  node.append(...children);
  return node;
}

function actionButton(action, label, ariaLabel = label) {
  return element(
    "button",
    { type: "button", className: "ghost", "data-action": action, "aria-label": ariaLabel },
    label,
  );
}

/** The conversation list; `current` is the open conversation's id. */
export function renderConversationList(list, conversations, current) {
  list.replaceChildren(
    ...conversations.map((conversation) => {
      const open = element(
        "button",
        { type: "button", className: "open", "data-action": "open" },
        conversation.title,
      );
      if (conversation.id === current) open.setAttribute("aria-current", "true");
      return element(
        "li",
        { className: "conversation", "data-id": conversation.id },
        open,
        actionButton("rename", "✎", `Rename ${conversation.title}`),
        actionButton("delete", "✕", `Delete ${conversation.title}`),
      );
    }),
  );
}

/** Swap a conversation's title for a text field; resolves with the new title, or null on Escape. */
export function editTitle(item, title) {
  return new Promise((resolve) => {
    const input = element("input", {
      type: "text",
      value: title,
      className: "rename-input",
      "aria-label": "New title",
    });
    const finish = (value) => {
      input.onblur = null;
      resolve(value);
    };
    input.onkeydown = (event) => {
      if (event.key === "Enter") finish(input.value.trim() || title);
      if (event.key === "Escape") finish(null);
    };
    input.onblur = () => finish(input.value.trim() || title);
    item.querySelector(".open").replaceWith(input);
    input.select();
  });
}

// The empty page's samples: pictures shipped with the page and questions the demo model
// (assets/demo-model) answers correctly (assets/samples/README.md).
export const SAMPLES = [
  {
    file: "shapes.png",
    alt: "A red circle, a green triangle and a blue square",
    questions: ["What colour is the circle?", "How many shapes are there?"],
  },
  {
    file: "four.png",
    alt: "A purple triangle, a black star, a red square and a green circle",
    questions: ["Where is the green circle?", "Describe the image."],
  },
];

function emptyState() {
  const samples = SAMPLES.map((sample) =>
    element(
      "figure",
      { className: "sample" },
      element("img", { src: `static/samples/${sample.file}`, alt: sample.alt }),
      element(
        "figcaption",
        {},
        ...sample.questions.map((question) =>
          element(
            "button",
            {
              type: "button",
              className: "ghost question",
              "data-sample": sample.file,
              "data-question": question,
            },
            question,
          ),
        ),
      ),
    ),
  );
  return element(
    "div",
    { className: "empty" },
    element(
      "p",
      {},
      "Attach an image (with the paper clip, by dragging it here, or by pasting it) and ask about it, or try a sample:",
    ),
    element("div", { className: "samples" }, ...samples),
  );
}

/** The whole thread. `streaming` is the message being generated, if any. */
export function renderThread(thread, messages, streaming) {
  if (!messages.length) {
    thread.replaceChildren(emptyState());
    return;
  }
  const last = messages.length - 1;
  thread.replaceChildren(
    ...messages.map((message, index) =>
      message.role === "user"
        ? userMessage(message, index, streaming !== null)
        : answer(message, index, { streaming: message === streaming, isLast: index === last && !streaming }),
    ),
  );
}

function userMessage(message, index, busy) {
  const images = message.images.map(({ url }, k) =>
    element("img", { src: url, alt: `Image ${k + 1} of your message`, loading: "lazy" }),
  );
  const edit = actionButton("edit", "Edit", "Edit and resend this message");
  edit.disabled = busy;
  return element(
    "article",
    { className: "message user", "data-index": index, "aria-label": "You" },
    images.length ? element("div", { className: "images" }, ...images) : "",
    element("div", { className: "text" }, message.text),
    element("div", { className: "actions" }, edit),
  );
}

/** Put a user message into edit mode; onSave(text) is called with the edited text. */
export function editMessage(article, text, onSave) {
  const field = element("textarea", { value: text, rows: 3, "aria-label": "Edit your message" });
  const save = element("button", { type: "submit", className: "primary" }, "Save and send");
  const cancel = element("button", { type: "button" }, "Cancel");
  const form = element(
    "form",
    { className: "edit" },
    field,
    element("div", { className: "actions" }, save, cancel),
  );
  form.onsubmit = (event) => {
    event.preventDefault();
    onSave(field.value);
  };
  const original = [...article.querySelectorAll(".text, .actions")];
  cancel.onclick = () => {
    form.replaceWith(...original);
    article.querySelector("[data-action=edit]").focus();
  };
  original[0].replaceWith(form);
  original[1].remove();
  field.focus();
}

function answer(message, index, { streaming, isLast }) {
  const body = element("div", { className: "markdown" });
  body.innerHTML = renderMarkdown(message.text); // safe: renderMarkdown escapes all model text
  const article = element("article", {
    className: "message assistant",
    "data-index": index,
    "aria-label": "Answer",
  });
  article.append(body);
  if (streaming) {
    article.setAttribute("aria-busy", "true");
    return article;
  }
  if (message.error) article.append(element("p", { className: "error" }, `Error: ${message.error}`));
  if (message.stopped) article.append(element("p", { className: "note" }, "Stopped."));
  if (message.stats) article.append(stats(message.stats));
  const actions = element("div", { className: "actions" });
  if (message.text) actions.append(actionButton("copy", "Copy", "Copy the answer"));
  if (isLast) actions.append(actionButton("regenerate", "Regenerate", "Regenerate this answer"));
  article.append(actions);
  return article;
}

/** While an answer streams in, only its text changes. */
export function updateStreamingAnswer(thread, message) {
  thread.lastElementChild.querySelector(".markdown").innerHTML = renderMarkdown(message.text);
}

function stats({ ttft_s, tokens_per_s, usage, sampling }) {
  const items = [];
  const stat = (name, text, title) =>
    items.push(element("span", { className: "stat", "data-stat": name, title }, text));
  if (sampling) stat("sampling", sampling, "how this answer was sampled (change it below the message box)");
  if (ttft_s != null) stat("ttft", `TTFT ${formatSeconds(ttft_s)}`, "time to first token");
  if (tokens_per_s != null)
    stat("speed", `${tokens_per_s.toFixed(1)} tok/s`, "decode speed after the first token, as the server timed it");
  if (usage) {
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    const share = usage.prompt_tokens ? cached / usage.prompt_tokens : 0;
    stat("prompt", `${usage.prompt_tokens} prompt`, "prompt tokens");
    stat("completion", `${usage.completion_tokens} completion`, "completion tokens");
    stat(
      "cache",
      `cache ${Math.round(share * 100)}%`,
      `${cached} of ${usage.prompt_tokens} prompt tokens came from the prefix cache`,
    );
  }
  return element("footer", { className: "stats", "aria-label": "Answer statistics" }, ...items);
}

function formatSeconds(seconds) {
  return seconds < 1 ? `${Math.round(seconds * 1000)} ms` : `${seconds.toFixed(2)} s`;
}
