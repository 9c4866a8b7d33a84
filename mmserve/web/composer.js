// The message composer: text, and images attached by file picker, drag-and-drop or paste.
//
// Images are read as data URLs as they are, without re-encoding, so the server sees exactly
// the bytes of the file the user chose.

const MAX_IMAGE_BYTES = 20 << 20; // well under the server's default 64 MiB request limit

/**
 * Wire the composer's elements. onSend({text, images}) returns true when the message was taken
 * (the composer then clears) and false when it was not (nothing is lost). onNotice(text) shows
 * a problem with an attachment.
 */
export function createComposer({
  form,
  textarea,
  fileInput,
  attachButton,
  list,
  dropZone,
  onSend,
  onNotice,
}) {
  let images = [];

  function showAttachments() {
    list.replaceChildren(
      ...images.map((url, index) => {
        const item = document.createElement("li");
        const img = document.createElement("img");
        img.src = url;
        img.alt = `Attached image ${index + 1}`;
        const remove = document.createElement("button");
        remove.type = "button";
        remove.className = "remove";
        remove.textContent = "×";
        remove.setAttribute("aria-label", `Remove image ${index + 1}`);
        remove.addEventListener("click", () => {
          images.splice(index, 1);
          showAttachments();
          textarea.focus();
        });
        item.append(img, remove);
        return item;
      }),
    );
    list.hidden = images.length === 0;
  }

  async function addFiles(files) {
    for (const file of files) {
      if (!file.type.startsWith("image/")) {
        onNotice(`${file.name} is not an image, so it was not attached.`);
      } else if (file.size > MAX_IMAGE_BYTES) {
        onNotice(`${file.name} is larger than ${MAX_IMAGE_BYTES >> 20} MiB, so it was not attached.`);
      } else {
        try {
          images.push(await readAsDataUrl(file));
        } catch (error) {
          onNotice(`${file.name} could not be read: ${error.message}`);
        }
      }
    }
    showAttachments();
  }

  function resize() {
    textarea.style.height = "auto";
    textarea.style.height = `${Math.min(textarea.scrollHeight, 240)}px`;
  }

  attachButton.addEventListener("click", () => fileInput.click());
  fileInput.addEventListener("change", async () => {
    await addFiles([...fileInput.files]);
    fileInput.value = ""; // so choosing the same file again fires "change" again
  });
  // Anywhere on the page, not only in the text box: users paste after clicking on the page.
  document.addEventListener("paste", (event) => {
    const files = [...event.clipboardData.files];
    if (!files.length) return; // plain text: let the browser paste it
    event.preventDefault();
    addFiles(files);
  });
  dropZone.addEventListener("dragover", (event) => {
    if (!event.dataTransfer.types.includes("Files")) return;
    event.preventDefault(); // allows the drop
    dropZone.classList.add("dragging");
  });
  dropZone.addEventListener("dragleave", (event) => {
    if (!dropZone.contains(event.relatedTarget)) dropZone.classList.remove("dragging");
  });
  dropZone.addEventListener("drop", (event) => {
    event.preventDefault();
    dropZone.classList.remove("dragging");
    addFiles([...event.dataTransfer.files]);
  });
  textarea.addEventListener("input", resize);
  textarea.addEventListener("keydown", (event) => {
    // isComposing: Enter that confirms an IME composition (Chinese, Japanese, ...) must not send.
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = textarea.value;
    if (!text.trim() && !images.length) return;
    if (!onSend({ text, images: [...images] })) return;
    textarea.value = "";
    images = [];
    showAttachments();
    resize();
  });
  showAttachments();
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}
