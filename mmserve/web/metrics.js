// Reading Prometheus text: samples by name, sums, rates and histogram quantiles between two
// scrapes. No server state beyond what /metrics exports.

const SAMPLE = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /(\w+)="((?:[^"\\]|\\.)*)"/g;

/** Prometheus text → Map(sample name → [{labels, value}]). */
export function parseMetrics(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = SAMPLE.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, key, value] of (match[2] ?? "").matchAll(LABEL)) labels[key] = value;
    if (!samples.has(match[1])) samples.set(match[1], []);
    samples.get(match[1]).push({ labels, value: Number(match[3]) });
  }
  return samples;
}

/** The sum of a sample's values over all its label sets (0 when absent). */
export function total(samples, name) {
  return (samples.get(name) ?? []).reduce((sum, sample) => sum + sample.value, 0);
}

/** Per-second increase of counter `name` from scrape `a` to scrape `b` ({t, samples}). */
export function rate(a, b, name) {
  const seconds = b.t - a.t;
  return seconds > 0 ? Math.max(0, total(b.samples, name) - total(a.samples, name)) / seconds : 0;
}

/** Δpart / Δwhole between two scrapes, or null when nothing happened. */
export function ratio(a, b, part, whole) {
  const denominator = whole.reduce((sum, name) => sum + total(b.samples, name) - total(a.samples, name), 0);
  if (denominator <= 0) return null;
  return (total(b.samples, part) - total(a.samples, part)) / denominator;
}

function buckets(samples, name) {
  const byBound = new Map();
  for (const { labels, value } of samples.get(`${name}_bucket`) ?? []) {
    const bound = labels.le === "+Inf" ? Infinity : Number(labels.le);
    byBound.set(bound, (byBound.get(bound) ?? 0) + value);
  }
  return byBound;
}

/**
 * The q-quantile of histogram `name` over the observations made between scrapes `a` and `b`,
 * interpolated linearly inside its bucket as Prometheus' histogram_quantile does; null when
 * there were none.
 */
export function quantile(a, b, name, q) {
  const before = buckets(a.samples, name);
  const counts = [...buckets(b.samples, name)]
    .map(([bound, count]) => [bound, count - (before.get(bound) ?? 0)])
    .sort((x, y) => x[0] - y[0]);
  const observed = counts.at(-1)?.[1] ?? 0;
  if (observed <= 0) return null;
  const rank = q * observed;
  let lower = 0;
  let below = 0;
  for (const [bound, count] of counts) {
    if (count >= rank) {
      if (bound === Infinity) return lower; // beyond the largest bucket: its lower edge
      return lower + ((bound - lower) * (rank - below)) / Math.max(count - below, 1e-12);
    }
    lower = bound;
    below = count;
  }
  return lower;
}
