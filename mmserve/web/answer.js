// One answer: the conversation put in the API's form, and the reply streamed into a message
// together with its statistics.

import { streamChat } from "./api.js";
import { requestFields } from "./settings.js";

/** The messages in the API's form: text and image_url parts; failed answers are left out. */
function apiMessages(messages, systemPrompt) {
  const result = systemPrompt.trim() ? [{ role: "system", content: systemPrompt }] : [];
  for (const message of messages) {
    if (message.role === "user") {
      const images = message.images.map((url) => ({ type: "image_url", image_url: { url } }));
      const text = message.text ? [{ type: "text", text: message.text }] : [];
      result.push({ role: "user", content: [...images, ...text] });
    } else if (!message.error) {
      result.push({ role: "assistant", content: message.text });
    }
  }
  return result;
}

/**
 * Stream the answer to `history` into `message` ({text}), calling onText() as text arrives.
 * It ends with message.stats set, and message.stopped (the signal aborted) or message.error (a
 * readable sentence) when it did not finish. It never throws: every failure lands on `message`.
 */
export async function streamAnswer(message, history, settings, { signal, onText }) {
  const body = { ...requestFields(settings), messages: apiMessages(history, settings.system_prompt) };
  const started = performance.now();
  let firstTokenAt = null;
  let usage = null;
  try {
    for await (const chunk of streamChat(body, { apiKey: settings.api_key, signal })) {
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        firstTokenAt ??= performance.now();
        message.text += delta;
        onText();
      }
      if (chunk.usage) usage = chunk.usage;
    }
  } catch (error) {
    if (error.name === "AbortError") message.stopped = true;
    else message.error = error.status ? `${error.message} (HTTP ${error.status})` : error.message;
  }
  message.stats = timings(started, firstTokenAt, performance.now(), usage);
}

// Decode speed counts the tokens after the first, over the time after the first.
function timings(started, firstTokenAt, ended, usage) {
  if (firstTokenAt === null) return usage && { ttft_s: null, tokens_per_s: null, usage };
  const decoded = (usage?.completion_tokens ?? 0) - 1;
  const decode_s = (ended - firstTokenAt) / 1000;
  return {
    ttft_s: (firstTokenAt - started) / 1000,
    tokens_per_s: decoded > 0 && decode_s > 0 ? decoded / decode_s : null,
    usage,
  };
}
