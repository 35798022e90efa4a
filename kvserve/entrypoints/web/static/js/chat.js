// The chat playground: a conversation streamed from /v1/chat/completions, with stop and regenerate, the
// sampling settings, and under each reply its time to first token, speed and cached prompt tokens. The
// conversation is kept in this browser's storage, so a reload or a closed tab does not lose it.

import { renderMarkdown } from './markdown.js';

const SETTINGS_KEY = 'kvserve.chatSettings';
const CONVERSATION_KEY = 'kvserve.conversation';
const RENDER_EVERY_MS = 40;   // re-render a streaming reply at most this often: one parse per frame or so
const AUTO_MODEL = '';        // the picker's "default": send no model, the server answers with its first model

function byId(id) {
  return document.getElementById(id);
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function formatMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

export class ChatView {
  constructor(api, { onUnauthorized }) {
    this.api = api;
    this.onUnauthorized = onUnauthorized;
    this.messages = [];        // { role, content, node, body, footer, state, stats }
    this.controller = null;    // the AbortController of the reply being generated, if any
    this.leaving = false;      // the page is going away
    this.el = {
      list: byId('messages'), empty: byId('chat-empty'), form: byId('composer'), prompt: byId('prompt'),
      send: byId('send'), stop: byId('stop'), clear: byId('clear-chat'), modelField: byId('model-field'),
      model: byId('model'), system: byId('system-prompt'), temperature: byId('temperature'), topP: byId('top-p'),
      maxTokens: byId('max-tokens'),
    };
    this.restoreSettings();
    this.restoreConversation();
    this.el.form.addEventListener('submit', (event) => {
      event.preventDefault();
      this.send();
    });
    this.el.prompt.addEventListener('keydown', (event) => {
      if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    this.el.stop.addEventListener('click', () => this.stop());
    // Leaving the page (a reload, a closed tab) cuts the stream: the reply is kept as stopped, not as failed.
    window.addEventListener('pagehide', () => {
      this.leaving = true;
      this.stop();
    });
    this.el.clear.addEventListener('click', () => this.clear());
    for (const input of [this.el.system, this.el.temperature, this.el.topP, this.el.maxTokens, this.el.model]) {
      input.addEventListener('change', () => this.saveSettings());
    }
  }

  // Fills the model picker from /v1/models; the picker shows only when there is a choice to make.
  async loadModels() {
    const list = await this.api.json('v1/models');
    const names = list.data.map((m) => m.id);
    const saved = this.el.model.value || this.savedSettings().model || AUTO_MODEL;
    const options = names.length > 1 ? [[AUTO_MODEL, 'default (the first model)'], ...names.map((n) => [n, n])]
      : names.map((n) => [n, n]);
    this.el.model.replaceChildren(...options.map(([value, label]) => {
      const option = element('option', undefined, label);
      option.value = value;
      return option;
    }));
    this.el.model.value = options.some(([value]) => value === saved) ? saved : options[0][0];
    this.el.modelField.hidden = names.length < 2;
    return list.data;
  }

  get generating() {
    return this.controller !== null;
  }

  send() {
    const text = this.el.prompt.value.trim();
    if (!text || this.generating) return;
    this.el.prompt.value = '';
    this.addMessage('user', text);
    this.generate(this.addMessage('assistant', ''));
    this.saveConversation();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  regenerate() {
    const last = this.messages[this.messages.length - 1];
    if (this.generating || !last || last.role !== 'assistant') return;
    this.messages.pop();
    last.node.remove();
    this.generate(this.addMessage('assistant', ''));
    this.saveConversation();
  }

  clear() {
    this.stop();
    for (const m of this.messages) m.node.remove();
    this.messages = [];
    this.el.empty.hidden = false;
    this.saveConversation();
  }

  addMessage(role, content) {
    const node = element('article', `msg msg-${role}`);
    node.dataset.role = role;
    const body = element('div', role === 'assistant' ? 'msg-body markdown' : 'msg-body plain');
    const footer = element('div', 'msg-footer');
    node.append(element('div', 'msg-role', role === 'user' ? 'You' : 'Assistant'), body, footer);
    const message = { role, content, node, body, footer, state: role === 'assistant' ? 'waiting' : 'done', stats: null };
    // A user's message is shown exactly as typed; a reply is rendered as Markdown (into text nodes only).
    if (role === 'user') body.textContent = content;
    node.dataset.state = message.state;
    this.el.empty.hidden = true;
    this.el.list.append(node);
    this.messages.push(message);
    this.scrollToEnd(true);
    return message;
  }

  settings() {
    const number = (input, parse) => {
      const v = parse(input.value);
      return Number.isFinite(v) ? v : undefined;   // left empty or invalid: the server's default
    };
    return {
      temperature: number(this.el.temperature, parseFloat),
      top_p: number(this.el.topP, parseFloat),
      max_tokens: number(this.el.maxTokens, (v) => parseInt(v, 10)),
    };
  }

  requestMessages(upTo) {
    const out = [];
    const system = this.el.system.value.trim();
    if (system) out.push({ role: 'system', content: system });
    const turns = this.messages.slice(0, upTo);
    turns.forEach((m, i) => {
      if (!m.content) return;
      // A question whose answer failed or was stopped before any text (a 400, a 401) stays out: sent again with
      // the next one, it made two user turns in a row, which templates that alternate roles refuse.
      const reply = turns[i + 1];
      if (m.role === 'user' && reply && reply.role === 'assistant' && !reply.content) return;
      out.push({ role: m.role, content: m.content });
    });
    return out;
  }

  async generate(message) {
    const index = this.messages.indexOf(message);
    const body = {
      messages: this.requestMessages(index),
      stream: true,
      stream_options: { include_usage: true },
      ...this.settings(),
    };
    if (this.el.model.value !== AUTO_MODEL) body.model = this.el.model.value;
    this.controller = new AbortController();
    this.setBusy(true);
    this.setState(message, 'waiting');
    const t0 = performance.now();
    let tFirst = null;
    let tLast = null;
    let pieces = 0;
    let usage = null;
    let finishReason = null;
    try {
      for await (const chunk of this.api.streamChat(body, this.controller.signal)) {
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        const text = choice.delta && choice.delta.content;
        if (text) {
          tLast = performance.now();
          if (tFirst === null) tFirst = tLast;
          pieces += 1;
          message.content += text;
          this.setState(message, 'streaming');
          this.scheduleRender(message);
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
      this.setState(message, finishReason === 'length' ? 'length' : 'done');
    } catch (e) {
      if (e.name === 'AbortError' || this.leaving) {
        this.setState(message, 'stopped');
      } else {
        message.error = e.message;
        this.setState(message, 'error');
        if (e.status === 401) this.onUnauthorized();
      }
    } finally {
      this.controller = null;
      this.setBusy(false);
    }
    const tokens = usage ? usage.completion_tokens : pieces;
    message.stats = {
      ttftMs: tFirst === null ? null : tFirst - t0,
      // Decode speed: tokens after the first over the time after the first.
      tokensPerS: tokens > 1 && tLast > tFirst ? (tokens - 1) / ((tLast - tFirst) / 1000) : null,
      tokens,
      promptTokens: usage ? usage.prompt_tokens : null,
      cachedTokens: usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null,
    };
    this.renderBody(message);
    this.renderFooter(message);
    this.renderActions();
  }

  setBusy(busy) {
    this.el.send.disabled = busy;
    this.el.stop.hidden = !busy;
    this.el.send.hidden = busy;
  }

  setState(message, state) {
    message.state = state;
    message.node.dataset.state = state;
  }

  scheduleRender(message) {
    if (message.renderTimer) return;
    const wait = Math.max(0, RENDER_EVERY_MS - (performance.now() - (message.renderedAt || 0)));
    message.renderTimer = setTimeout(() => {
      message.renderTimer = null;
      this.renderBody(message);
    }, wait);
  }

  renderBody(message) {
    clearTimeout(message.renderTimer);
    message.renderTimer = null;
    message.renderedAt = performance.now();
    const nearEnd = this.isNearEnd();
    const content = renderMarkdown(message.content);
    if (message.state === 'error') content.append(element('p', 'msg-error', message.error));
    message.body.replaceChildren(content);
    this.scrollToEnd(nearEnd);
    this.saveConversation();   // as often as the reply is drawn: a reload mid-reply keeps what was shown
  }

  renderFooter(message) {
    const s = message.stats || {};   // none for a reply cut off by a reload
    const parts = [];
    const stat = (name, text) => {
      const span = element('span', 'stat', text);
      span.dataset.stat = name;
      parts.push(span);
    };
    if (s.ttftMs != null) stat('ttft', `TTFT ${formatMs(s.ttftMs)}`);
    if (s.tokensPerS != null) stat('tps', `${s.tokensPerS.toFixed(1)} tok/s`);
    if (s.tokens) stat('tokens', `${s.tokens} tokens`);
    if (s.cachedTokens != null && s.promptTokens != null) {
      stat('cached', `${s.cachedTokens} of ${s.promptTokens} prompt tokens cached`);
    }
    if (message.state === 'stopped') stat('end', 'stopped');
    if (message.state === 'length') stat('end', 'reached max tokens');
    const stats = element('span', 'stats');
    stats.append(...parts);
    message.footer.replaceChildren(stats);
  }

  // Regenerate belongs to the last reply only (it replaces that reply).
  renderActions() {
    for (const node of this.el.list.querySelectorAll('.msg-actions')) node.remove();
    const last = this.messages[this.messages.length - 1];
    if (!last || last.role !== 'assistant' || this.generating) return;
    const actions = element('span', 'msg-actions');
    const button = element('button', 'quiet small', 'Regenerate');
    button.type = 'button';
    button.dataset.action = 'regenerate';
    button.addEventListener('click', () => this.regenerate());
    actions.append(button);
    last.footer.append(actions);
  }

  isNearEnd() {
    const list = this.el.list;
    return list.scrollHeight - list.scrollTop - list.clientHeight < 80;
  }

  scrollToEnd(really) {
    if (really) this.el.list.scrollTop = this.el.list.scrollHeight;
  }

  saveConversation() {
    const saved = this.messages.map(({ role, content, state, stats, error }) => ({ role, content, state, stats, error }));
    try {
      if (saved.length) localStorage.setItem(CONVERSATION_KEY, JSON.stringify(saved));
      else localStorage.removeItem(CONVERSATION_KEY);
    } catch {
      // Storage full or turned off: the conversation lasts as long as the page.
    }
  }

  restoreConversation() {
    let saved;
    try {
      saved = JSON.parse(localStorage.getItem(CONVERSATION_KEY));
    } catch {
      return;
    }
    if (!Array.isArray(saved)) return;
    for (const m of saved) {
      if (!m || !['user', 'assistant'].includes(m.role) || typeof m.content !== 'string') continue;
      const message = this.addMessage(m.role, m.content);
      if (m.role !== 'assistant') continue;
      // A reply still coming when the page went away ends where it was: stopped.
      this.setState(message, ['waiting', 'streaming'].includes(m.state) ? 'stopped' : String(m.state));
      message.error = m.error;
      message.stats = m.stats && typeof m.stats === 'object' ? m.stats : null;
      this.renderBody(message);
      this.renderFooter(message);
    }
    this.renderActions();
    this.saveConversation();
  }

  savedSettings() {
    try {
      return JSON.parse(localStorage.getItem(SETTINGS_KEY)) || {};
    } catch {
      return {};
    }
  }

  saveSettings() {
    localStorage.setItem(SETTINGS_KEY, JSON.stringify({
      system: this.el.system.value, temperature: this.el.temperature.value, topP: this.el.topP.value,
      maxTokens: this.el.maxTokens.value, model: this.el.model.value,
    }));
  }

  restoreSettings() {
    const s = this.savedSettings();
    if (s.system !== undefined) this.el.system.value = s.system;
    if (s.temperature !== undefined) this.el.temperature.value = s.temperature;
    if (s.topP !== undefined) this.el.topP.value = s.topP;
    if (s.maxTokens !== undefined) this.el.maxTokens.value = s.maxTokens;
  }
}
