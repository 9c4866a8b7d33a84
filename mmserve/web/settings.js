// User settings (persisted in localStorage), the settings form, and the light/dark toggle.

const SETTINGS_KEY = "mmserve.settings";
const THEME_KEY = "mmserve.theme";

// Kept as the strings the user typed; empty means "the server's default".
const DEFAULTS = { model: "", temperature: "", max_tokens: "512", system_prompt: "", api_key: "" };

export function loadSettings() {
  try {
    return { ...DEFAULTS, ...JSON.parse(localStorage.getItem(SETTINGS_KEY) ?? "{}") };
  } catch {
    return { ...DEFAULTS }; // unreadable (hand-edited, or storage disabled): start afresh
  }
}

/** Show `settings` in the form; every edit updates and saves it, then calls onChange(name). */
export function bindSettingsForm(form, settings, onChange) {
  for (const [name, value] of Object.entries(settings)) {
    if (form.elements[name]) form.elements[name].value = value;
  }
  form.addEventListener("input", (event) => {
    const { name, value } = event.target;
    if (!(name in settings)) return;
    settings[name] = value;
    localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
    onChange(name);
  });
}

/** Change one setting as the form would: the field shows it and it is saved. */
export function changeSetting(form, settings, name, value) {
  settings[name] = value;
  if (form.elements[name]) form.elements[name].value = value;
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

/** How answers are sampled, in words: greedy (temperature 0) or at which temperature. */
export function samplingSummary(settings) {
  const temperature = settings.temperature.trim();
  const length = settings.max_tokens.trim() ? `at most ${settings.max_tokens.trim()} tokens` : "no token limit";
  if (temperature === "") return `Sampling at the model's default temperature: answers vary · ${length}`;
  if (Number(temperature) === 0) return `Greedy (temperature 0): the same question, the same answer · ${length}`;
  return `Sampling at temperature ${temperature}: answers vary · ${length}`;
}

/** The stat an answer keeps of how it was sampled. */
export function samplingLabel(settings) {
  const temperature = settings.temperature.trim();
  if (temperature === "") return "sampled (model default temperature)";
  return Number(temperature) === 0 ? "greedy" : `temperature ${temperature}`;
}

/** Fill the model picker with the served models, keeping the saved choice if it is served. */
export function showModels(select, ids, settings) {
  select.replaceChildren(...ids.map((id) => new Option(id, id)));
  if (!ids.includes(settings.model)) settings.model = ids[0] ?? "";
  select.value = settings.model;
}

/**
 * The request fields the settings set. Values are not checked here: the server validates them,
 * and its 400 message says what is wrong better than a second set of rules would.
 */
export function requestFields(settings) {
  const fields = {};
  if (settings.model) fields.model = settings.model;
  for (const name of ["temperature", "max_tokens"]) {
    if (settings[name].trim() !== "") fields[name] = Number(settings[name]);
  }
  return fields;
}

/** The toggle flips between light and dark; until it is used, the system's preference rules. */
export function bindThemeToggle(button) {
  const root = document.documentElement;
  const systemDark = matchMedia("(prefers-color-scheme: dark)");
  const current = () => root.dataset.theme ?? (systemDark.matches ? "dark" : "light");
  const label = () => {
    const next = current() === "dark" ? "light" : "dark";
    button.setAttribute("aria-label", `Switch to ${next} theme`);
    button.title = `Switch to ${next} theme`;
  };
  const saved = localStorage.getItem(THEME_KEY);
  if (saved === "light" || saved === "dark") root.dataset.theme = saved;
  button.addEventListener("click", () => {
    root.dataset.theme = current() === "dark" ? "light" : "dark";
    localStorage.setItem(THEME_KEY, root.dataset.theme);
    label();
  });
  systemDark.addEventListener("change", label);
  label();
}
