// Adapter upload through XMLHttpRequest: fetch() cannot report upload
// progress, XHR's `upload.onprogress` can.
import { apiUrl, authHeaders, errorFromBody, ApiError } from "./api.js";

const ARCHIVE = /\.(zip|tar\.gz|tgz)$/i;
const PEFT_FILES = ["adapter_config.json", "adapter_model.safetensors"];

// A usable selection: one archive, or exactly the two files PEFT writes.
// Returns an error message, or null when the selection can be sent.
export function checkSelection(files) {
  if (files.length === 0) return "Choose the adapter files first.";
  if (files.length === 1 && ARCHIVE.test(files[0].name)) return null;
  const names = files.map((f) => f.name).sort();
  if (names.some((n) => /\.(bin|pt|pth|pkl)$/i.test(n))) {
    return "Pickled weights (.bin/.pt) are not accepted: save the adapter with safetensors.";
  }
  if (names.length === 2 && names[0] === PEFT_FILES[0] && names[1] === PEFT_FILES[1]) return null;
  return `Choose ${PEFT_FILES.join(" and ")}, or one .zip / .tar.gz holding them.`;
}

// Resolves with the created adapter record; onProgress(loaded, total) while sending.
export function uploadAdapter({ name, description, files, onProgress, signal }) {
  const form = new FormData();
  form.append("name", name);
  if (description) form.append("description", description);
  for (const file of files) form.append("files", file, file.name);

  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", apiUrl("/v1/adapters"));
    for (const [header, value] of Object.entries(authHeaders())) xhr.setRequestHeader(header, value);
    xhr.responseType = "text";
    xhr.upload.addEventListener("progress", (event) => {
      if (event.lengthComputable) onProgress?.(event.loaded, event.total);
    });
    xhr.addEventListener("load", () => {
      if (xhr.status >= 200 && xhr.status < 300) {
        try {
          resolve(JSON.parse(xhr.responseText));
        } catch {
          resolve(null);
        }
      } else {
        reject(errorFromBody(xhr.status, xhr.responseText));
      }
    });
    xhr.addEventListener("error", () => reject(new ApiError(0, "The upload failed: the connection was lost.")));
    xhr.addEventListener("abort", () => reject(new DOMException("Upload cancelled", "AbortError")));
    signal?.addEventListener("abort", () => xhr.abort());
    xhr.send(form);
  });
}
