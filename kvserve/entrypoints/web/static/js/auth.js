// The API key: asked for once, kept in this browser's storage (this tab only, or this device when the user
// ticks "remember"), sent only as a header by api.js.

const STORAGE_KEY = 'kvserve.apiKey';

export const keyStore = {
  get() {
    return sessionStorage.getItem(STORAGE_KEY) || localStorage.getItem(STORAGE_KEY);
  },
  set(key, remember) {
    sessionStorage.setItem(STORAGE_KEY, key);
    if (remember) localStorage.setItem(STORAGE_KEY, key);
    else localStorage.removeItem(STORAGE_KEY);
  },
  clear() {
    sessionStorage.removeItem(STORAGE_KEY);
    localStorage.removeItem(STORAGE_KEY);
  },
  // Both copies as they are, and back: a key that turned out wrong must leave a remembered one in place.
  snapshot() {
    return [sessionStorage.getItem(STORAGE_KEY), localStorage.getItem(STORAGE_KEY)];
  },
  restore([session, local]) {
    for (const [storage, value] of [[sessionStorage, session], [localStorage, local]]) {
      if (value === null) storage.removeItem(STORAGE_KEY);
      else storage.setItem(STORAGE_KEY, value);
    }
  },
};

// Shows the key dialog until a key that /v1/models accepts is entered, or the user closes it (Escape).
// Resolves with the stored key then (null if there is none).
export function askForKey(api, message) {
  const dialog = document.getElementById('key-dialog');
  const form = document.getElementById('key-form');
  const input = document.getElementById('key-input');
  const remember = document.getElementById('key-remember');
  const error = document.getElementById('key-error');
  const closed = new Promise((resolve) => {
    dialog.addEventListener('close', () => resolve(keyStore.get()), { once: true });
  });
  if (dialog.open) return closed;   // already asking: wait for that answer

  error.hidden = !message;
  error.textContent = message || '';
  input.value = '';
  const onSubmit = async (event) => {
    event.preventDefault();
    const key = input.value.trim();
    if (!key) return;
    const previous = keyStore.snapshot();
    keyStore.set(key, remember.checked);
    try {
      await api.json('v1/models');
    } catch (e) {
      keyStore.restore(previous);
      error.hidden = false;
      error.textContent = e.status === 401 ? 'The server did not accept this key.' : e.message;
      return;
    }
    dialog.close();
  };
  form.addEventListener('submit', onSubmit);
  dialog.addEventListener('close', () => form.removeEventListener('submit', onSubmit), { once: true });
  dialog.showModal();
  input.focus();
  return closed;
}
