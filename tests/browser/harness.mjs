// What the browser tests share: reading their environment, failing with a reason, and the flags
// Debian's Chromium runs headless with on a machine without a network.
export const CHROMIUM_ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic',
  '--no-first-run', '--disable-background-networking', '--disable-component-update',
  '--disable-sync'];

// `fail(message)` ends the test with `LABEL failed: message` on stderr and a non-zero exit;
// `env(name, fallback)` reads a setting, failing when it is missing.
export function harness(label) {
  const fail = (message) => {
    console.error(`${label} failed: ${message}`);
    process.exit(1);
  };
  const env = (name, fallback) => {
    const value = process.env[name] ?? fallback;
    if (value == null || value === '') fail(`environment variable ${name} is not set`);
    return value;
  };
  return { fail, env };
}
