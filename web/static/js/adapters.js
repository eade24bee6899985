// Adapters page: the tenant's adapters with live status, upload, delete.
import { apiJson } from "./api.js";
import { clearError, h, showError } from "./dom.js";
import { formatBytes, formatDateTime } from "./format.js";
import { requireApiKey, root } from "./session.js";
import { checkSelection, uploadAdapter } from "./upload.js";

const POLL_MS = 1500;
const NAME_RULE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;  // the API's rule, checked here for quick feedback

const listError = document.getElementById("list-error");
const listStatus = document.getElementById("list-status");
const table = document.getElementById("adapters-table");
const tbody = document.getElementById("adapters-body");
const emptyNote = document.getElementById("adapters-empty");

const form = document.getElementById("upload-form");
const nameInput = document.getElementById("adapter-name");
const descriptionInput = document.getElementById("adapter-description");
const fileInput = document.getElementById("adapter-files");
const dropzone = document.getElementById("dropzone");
const fileList = document.getElementById("file-list");
const progressBox = document.getElementById("upload-progress");
const progressBar = document.getElementById("upload-bar");
const progressText = document.getElementById("upload-status");
const uploadError = document.getElementById("upload-error");
const submitButton = document.getElementById("upload-submit");
const cancelButton = document.getElementById("upload-cancel");

const dialog = document.getElementById("delete-dialog");
const dialogText = document.getElementById("delete-text");

let selectedFiles = [];
let pollTimer = null;
let uploadController = null;
let uploadedName = null;  // the last upload, whose validation the progress line follows

// ---- list -------------------------------------------------------------------

function statusBadge(status) {
  const label = { validating: "Validating", ready: "Ready", failed: "Failed" }[status] ?? status;
  return h("span", { class: `badge badge-${status}`, "data-status": status }, label);
}

function adapterRow(adapter) {
  const nameCell = h("td", { class: "cell-name", "data-label": "Name" },
    h("span", { class: "adapter-name" }, adapter.name),
    adapter.description ? h("span", { class: "adapter-description" }, adapter.description) : null,
    adapter.status === "failed" && adapter.reason
      ? h("span", { class: "failure-reason", role: "note" }, adapter.reason) : null);
  const playLink = adapter.status === "ready"
    ? h("a", { class: "btn btn-quiet btn-small", href: `${root}/portal/playground?model=${encodeURIComponent(adapter.name)}` }, "Try")
    : null;
  const deleteButton = h("button", {
    type: "button", class: "btn btn-danger-quiet btn-small", "aria-label": `Delete ${adapter.name}`,
    onclick: () => confirmDelete(adapter),
  }, "Delete");
  return h("tr", { "data-adapter": adapter.name, "data-status": adapter.status },
    nameCell,
    h("td", { "data-label": "Status" }, statusBadge(adapter.status)),
    h("td", { "data-label": "Rank / alpha" }, adapter.rank ? `${adapter.rank} / ${adapter.alpha ?? "—"}` : "—"),
    h("td", { class: "cell-modules", "data-label": "Targets" }, (adapter.target_modules ?? []).join(", ") || "—"),
    h("td", { class: "nowrap", "data-label": "Size" }, adapter.size_bytes ? formatBytes(adapter.size_bytes) : "—"),
    h("td", { "data-label": "Created" }, formatDateTime(adapter.created_at)),
    h("td", { class: "cell-actions" }, playLink, deleteButton));
}

function render(adapters) {
  tbody.replaceChildren(...adapters.map(adapterRow));
  table.hidden = adapters.length === 0;
  emptyNote.hidden = adapters.length !== 0;
  const validating = adapters.filter((a) => a.status === "validating").length;
  listStatus.textContent = validating ? `Validating ${validating}… (refreshing)` : "";
  const uploaded = adapters.find((a) => a.name === uploadedName);
  if (uploaded && uploaded.status !== "validating") {
    progressText.textContent = uploaded.status === "ready"
      ? `“${uploaded.name}” is ready to use.`
      : `“${uploaded.name}” failed validation; the reason is shown below.`;
    uploadedName = null;
  }
}

async function refresh() {
  clearTimeout(pollTimer);
  try {
    const { data } = await apiJson("/v1/adapters");
    clearError(listError);
    render(data);
    // keep polling only while something is still being validated
    if (data.some((a) => a.status === "validating")) pollTimer = setTimeout(refresh, POLL_MS);
  } catch (err) {
    showError(listError, `Cannot load adapters: ${err.message}`);
    // a refusal (e.g. a key without the adapters scope) stays a refusal; outages may pass
    if (!(err.status >= 400 && err.status < 500)) pollTimer = setTimeout(refresh, POLL_MS * 4);
  }
}

// ---- delete -----------------------------------------------------------------

function confirmDelete(adapter) {
  dialogText.textContent = `“${adapter.name}” will be removed and can no longer be used in requests. This cannot be undone.`;
  dialog.returnValue = "";
  dialog.onclose = async () => {
    if (dialog.returnValue !== "delete") return;
    try {
      await apiJson(`/v1/adapters/${encodeURIComponent(adapter.id)}`, { method: "DELETE" });
      clearError(listError);
    } catch (err) {
      showError(listError, `Cannot delete “${adapter.name}”: ${err.message}`);
    }
    refresh();
  };
  dialog.showModal();
  document.getElementById("delete-cancel").focus();
}

// ---- upload -----------------------------------------------------------------

function setFiles(files) {
  selectedFiles = files;
  fileList.replaceChildren(...files.map((f) =>
    h("li", {}, h("span", { class: "file-name" }, f.name), h("span", { class: "muted" }, formatBytes(f.size)))));
  clearError(uploadError);
  if (files.length) progressBox.hidden = true;
  // a name taken from the archive saves typing; the user can still change it
  if (!nameInput.value && files.length === 1) {
    nameInput.value = files[0].name.replace(/\.(zip|tar\.gz|tgz)$/i, "").replace(/[^A-Za-z0-9._-]+/g, "-");
  }
}

fileInput.addEventListener("change", () => setFiles([...fileInput.files]));

for (const type of ["dragenter", "dragover"]) {
  dropzone.addEventListener(type, (event) => {
    event.preventDefault();
    dropzone.classList.add("dragging");
  });
}
for (const type of ["dragleave", "drop"]) {
  dropzone.addEventListener(type, () => dropzone.classList.remove("dragging"));
}
dropzone.addEventListener("drop", (event) => {
  event.preventDefault();
  setFiles([...(event.dataTransfer?.files ?? [])]);
});

function setUploading(on) {
  submitButton.disabled = on;
  fileInput.disabled = on;
  nameInput.readOnly = on;
  cancelButton.hidden = !on;
  dropzone.classList.toggle("disabled", on);
}

function showProgress(loaded, total) {
  const percent = total ? Math.round((loaded / total) * 100) : 0;
  progressBar.value = percent;
  progressText.textContent = `Uploading… ${percent}% (${formatBytes(loaded)} of ${formatBytes(total)})`;
}

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  clearError(uploadError);
  const name = nameInput.value.trim();
  const problem = !name ? "Give the adapter a name."
    : !NAME_RULE.test(name) ? "Names are 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit."
    : checkSelection(selectedFiles);
  if (problem) {
    showError(uploadError, problem);
    return;
  }
  uploadController = new AbortController();
  setUploading(true);
  progressBox.hidden = false;
  showProgress(0, selectedFiles.reduce((sum, f) => sum + f.size, 0));
  try {
    await uploadAdapter({
      name, description: descriptionInput.value.trim(), files: selectedFiles,
      onProgress: showProgress, signal: uploadController.signal,
    });
    progressBar.value = 100;
    progressText.textContent = `Uploaded “${name}”; validating…`;
    uploadedName = name;
    form.reset();
    setFiles([]);
    refresh();
  } catch (err) {
    progressBox.hidden = true;
    showError(uploadError, err.name === "AbortError" ? "Upload cancelled." : err.message);
  } finally {
    uploadController = null;
    setUploading(false);
  }
});

cancelButton.addEventListener("click", () => uploadController?.abort());

if (requireApiKey()) refresh();
