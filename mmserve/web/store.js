// Conversations in IndexedDB, images included: each image keeps its data URL (the local copy,
// which survives the server losing the file) beside the server's file id (uploads.js).
//
// Two object stores, written together in one transaction: "meta" ({id, title, updated_at}) is
// small and read whole to draw the sidebar; "messages" ({id, messages}) holds the heavy part and
// is read one conversation at a time. Every function returns a promise that rejects with the
// DOMException IndexedDB raised; a full disk shows up as name "QuotaExceededError".

const DB_NAME = "mmserve-chat";
const DB_VERSION = 1;

let opened = null;

function db() {
  opened ??= new Promise((resolve, reject) => {
    const request = indexedDB.open(DB_NAME, DB_VERSION);
    request.onupgradeneeded = () => {
      request.result.createObjectStore("meta", { keyPath: "id" });
      request.result.createObjectStore("messages", { keyPath: "id" });
    };
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
  return opened;
}

// Run `work(stores)` in one transaction; resolve with its result once the transaction commits.
async function transaction(mode, work) {
  const tx = (await db()).transaction(["meta", "messages"], mode);
  const committed = new Promise((resolve, reject) => {
    tx.oncomplete = resolve;
    tx.onabort = () => reject(tx.error ?? new Error("storage transaction aborted"));
  });
  let result;
  try {
    result = work({ meta: tx.objectStore("meta"), messages: tx.objectStore("messages") });
  } catch (error) {
    committed.catch(() => {}); // the caller hears of the failure through `error`
    tx.abort();
    throw error;
  }
  await committed;
  return result instanceof IDBRequest ? result.result : result;
}

/** Every conversation's {id, title, updated_at}, newest first. */
export async function listConversations() {
  const all = await transaction("readonly", ({ meta }) => meta.getAll());
  return all.sort((a, b) => b.updated_at - a.updated_at);
}

/** The messages of one conversation ([] if it was never saved). */
export async function loadMessages(id) {
  const row = await transaction("readonly", ({ messages }) => messages.get(id));
  return (row?.messages ?? []).map(withImageRecords);
}

// Conversations saved before uploads kept each image as its data URL alone; it is uploaded
// on the next request.
function withImageRecords(message) {
  if (message.role !== "user") return message;
  const images = message.images.map((image) => (typeof image === "string" ? { url: image, fileId: null } : image));
  return { ...message, images };
}

export function saveConversation({ id, title, updated_at, messages }) {
  return transaction("readwrite", (stores) => {
    stores.meta.put({ id, title, updated_at });
    stores.messages.put({ id, messages });
  });
}

export function saveTitle({ id, title, updated_at }) {
  return transaction("readwrite", ({ meta }) => meta.put({ id, title, updated_at }));
}

export function deleteConversation(id) {
  return transaction("readwrite", (stores) => {
    stores.meta.delete(id);
    stores.messages.delete(id);
  });
}
