// Talking to the server: JSON requests with the API key, and the OpenAI chat stream read as server-sent events.

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
  }

  // The server answers errors as OpenAI's JSON ({"error": {"message": ...}}); anything else keeps its status text.
  static async from(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = `${response.status}: ${body.error.message}`;
    } catch {
      // not JSON: keep the status line
    }
    return new ApiError(message, response.status);
  }
}

export class Api {
  // keys: { get(): string|null } - the key is read per request, so a key entered later is used at once.
  constructor(keys) {
    this.keys = keys;
  }

  headers(json) {
    const headers = {};
    if (json) headers['Content-Type'] = 'application/json';
    const key = this.keys.get();
    if (key) headers.Authorization = `Bearer ${key}`;   // never in the URL, where logs and history would keep it
    return headers;
  }

  async request(path, { method = 'GET', body, signal } = {}) {
    const response = await fetch(path, {
      method,
      headers: this.headers(body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
      cache: 'no-store',
    });
    if (!response.ok) throw await ApiError.from(response);
    return response;
  }

  async json(path, options) {
    return (await this.request(path, options)).json();
  }

  // Yields each chat.completion.chunk of a streaming /v1/chat/completions request, in order.
  async *streamChat(body, signal) {
    const response = await this.request('v1/chat/completions', { method: 'POST', body, signal });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      // Events end with a blank line; a read may hold several events or part of one.
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split('\n')) {
          if (!line.startsWith('data:')) continue;
          const data = line.slice(5).trim();
          if (data === '[DONE]') return;
          const chunk = JSON.parse(data);
          // An error after the stream started arrives as an event of its own.
          if (chunk.error) throw new ApiError(chunk.error.message || 'the stream failed', chunk.error.code || 500);
          yield chunk;
        }
      }
    }
  }
}
