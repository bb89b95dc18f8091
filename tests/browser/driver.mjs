// Drives Debian's chromium (headless, through playwright-core) for
// the browser tests (tests/browser_driver.py): one JSON command per line on stdin, one JSON
// answer per line on stdout ({"ok": true, ...} or {"ok": false, "error": "..."}).
//
//   FLEET_BROWSER_MODULES  the directory whose node_modules holds playwright-core
//   CHROMIUM               the browser binary (`which chromium`)
//
// Commands: open {url} -> {url, weight}; wait {js, timeout}; eval {js}; click {selector};
// hash {hash}; shot {path}; errors; quit. `weight` is the first load's requests and bytes
// (bodies and headers, from playwright's network events, after the network went idle).
import { createRequire } from "node:module";
import { join } from "node:path";
import { createInterface } from "node:readline";

const modules = process.env.FLEET_BROWSER_MODULES;
const require = createRequire(join(modules, "package.json"));
const { chromium } = require("playwright-core");

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM,
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
});
const context = await browser.newContext({ viewport: { width: 1400, height: 900 } });
const page = await context.newPage();
const errors = [];
const responses = [];
let counting = false;
page.on("pageerror", (err) => errors.push(`pageerror: ${err.message}`));
page.on("console", (msg) => { if (msg.type() === "error") errors.push(`console: ${msg.text()}`); });
page.on("dialog", (dialog) => dialog.accept());  // the purge confirmation
page.on("response", (resp) => { if (counting) responses.push(resp); });

async function weight() {
  let bytes = 0;
  const items = [];
  for (const resp of responses) {
    const sizes = await resp.request().sizes();
    const size = sizes.responseBodySize + sizes.responseHeadersSize;
    bytes += size;
    items.push({ url: resp.url(), status: resp.status(), bytes: size });
  }
  return { requests: responses.length, bytes, items };
}

const commands = {
  async open({ url }) {
    counting = true;
    await page.goto(url, { waitUntil: "networkidle", timeout: 30000 });
    counting = false;
    return { url: page.url(), weight: await weight() };
  },
  // polled from here: page.evaluate is not subject to the page's CSP, waitForFunction's
  // in-page polling is (it evaluates the string, and the page allows no eval)
  async wait({ js, timeout }) {
    const deadline = Date.now() + (timeout || 20000);
    for (;;) {
      const value = await page.evaluate(js);
      if (value) return { value };
      if (Date.now() > deadline) throw new Error(`timed out after ${timeout || 20000} ms waiting for: ${js}`);
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
  },
  async eval({ js }) { return { value: await page.evaluate(js) }; },
  async click({ selector }) { await page.click(selector, { timeout: 10000 }); return {}; },
  async hash({ hash }) { await page.evaluate((h) => { location.hash = h; }, hash); return {}; },
  async shot({ path }) { await page.screenshot({ path, fullPage: true }); return { path }; },
  async errors() { return { errors }; },
};

const lines = createInterface({ input: process.stdin });
process.stdout.write(JSON.stringify({ ok: true, ready: true, version: browser.version() }) + "\n");
for await (const line of lines) {
  const cmd = JSON.parse(line);
  if (cmd.cmd === "quit") break;
  let answer;
  try {
    answer = { ok: true, ...(await commands[cmd.cmd](cmd)) };
  } catch (err) {
    answer = { ok: false, error: String(err && err.message ? err.message : err).slice(0, 2000) };
  }
  process.stdout.write(JSON.stringify(answer) + "\n");
}
await browser.close();
