// Server-sent events over fetch: EventSource cannot send an Authorization
// header or a POST body, so the stream is read and split by hand.

// Yields the `data:` payload of each event (multi-line data joined by "\n").
export async function* sseEvents(body, signal = null) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  try {
    while (true) {
      if (signal?.aborted) return;
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let newline;
      while ((newline = buffer.search(/\r\n|\r|\n/)) !== -1) {
        const line = buffer.slice(0, newline);
        buffer = buffer.slice(newline + (buffer.startsWith("\r\n", newline) ? 2 : 1));
        if (line === "") {
          if (data.length) yield data.join("\n");
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        }
        // comments (":") and other fields (event, id, retry) carry nothing we use
      }
    }
    if (data.length) yield data.join("\n");
  } finally {
    reader.releaseLock();
  }
}

// Yields parsed OpenAI chat.completion.chunk objects until `data: [DONE]`.
// An error event mid-stream ({"error": {...}}) is thrown with its message.
export async function* chatChunks(body, signal = null) {
  for await (const data of sseEvents(body, signal)) {
    if (data.trim() === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message ?? "The stream failed");
    yield chunk;
  }
}

// Yields parsed Responses API stream events (response.created ... response.completed).
// An `error` event is thrown with its message.
export async function* responseEvents(body, signal = null) {
  for await (const data of sseEvents(body, signal)) {
    if (data.trim() === "[DONE]") return;
    const event = JSON.parse(data);
    if (event.type === "error") throw new Error(event.message ?? "The stream failed");
    yield event;
  }
}
