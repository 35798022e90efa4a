// Starts the page: learns from /api/info whether a key is needed, wires the two views to the URL's hash
// (#chat, #dashboard), asks for the key when the chat needs it, and fills the model picker.

import { Api } from './api.js';
import { askForKey, keyStore } from './auth.js';
import { ChatView } from './chat.js';
import { DashboardView } from './dashboard.js';

async function main() {
  const info = await (await fetch('api/info', { cache: 'no-store' })).json();
  const api = new Api(keyStore);
  const status = document.getElementById('server-status');
  const keyButton = document.getElementById('key-button');

  const loadModels = async () => {
    try {
      const models = await chat.loadModels();
      status.textContent = `${models.map((m) => m.id).join(', ')} · context ${models[0].max_model_len} tokens`;
      status.dataset.state = 'ok';
    } catch (e) {
      status.textContent = e.status === 401 ? 'API key needed' : `cannot list models: ${e.message}`;
      status.dataset.state = 'error';
      return e.status;
    }
    return 200;
  };
  const requestKey = async (message) => {
    await askForKey(api, message);
    if (keyStore.get()) await loadModels();
  };
  const chat = new ChatView(api, { onUnauthorized: () => requestKey('The server refused the key. Enter it again.') });
  const dashboard = new DashboardView({
    tiles: document.getElementById('tiles'),
    charts: document.getElementById('charts'),
    status: document.getElementById('dash-status'),
    windowSelect: document.getElementById('dash-window'),
    intervalS: info.dashboard_interval_s,
  });

  // Ask for a missing key when the chat is first shown, not before: the dashboard needs none.
  let keyAsked = false;
  const show = () => {
    const view = window.location.hash === '#dashboard' ? 'dashboard' : 'chat';
    document.getElementById('view-chat').hidden = view !== 'chat';
    document.getElementById('view-dashboard').hidden = view !== 'dashboard';
    for (const tab of document.querySelectorAll('.tab')) {
      if (tab.id === `tab-${view}`) tab.setAttribute('aria-current', 'page');
      else tab.removeAttribute('aria-current');
    }
    if (view === 'dashboard' && !document.hidden) dashboard.start();
    else dashboard.stop();
    if (view === 'chat' && info.api_key_required && !keyStore.get() && !keyAsked) {
      keyAsked = true;
      requestKey();
    }
  };
  window.addEventListener('hashchange', show);
  document.addEventListener('visibilitychange', show);

  if (info.api_key_required) {
    keyButton.hidden = false;
    keyButton.addEventListener('click', () => requestKey());
  }
  show();
  if (!info.api_key_required || keyStore.get()) {
    // A remembered key the server no longer takes: asked for now, not after the first message fails.
    if (await loadModels() === 401 && !keyAsked && window.location.hash !== '#dashboard') {
      keyAsked = true;
      requestKey('The server did not accept the saved key. Enter it again.');
    }
  } else status.textContent = 'API key needed';
  document.body.dataset.ready = 'true';   // for tests and scripts: the page has finished starting
}

main();
