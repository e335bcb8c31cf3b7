// Drives Ollama Chat (a web UI that speaks only Ollama's API) in headless Chromium: the models
// it lists, a chat answer, and an admin pull's progress. Prints one JSON document of what the
// page showed; screenshots go to OUT_DIR.
// Usage: node webui.mjs UI_URL OUT_DIR
import { chromium } from "playwright-core";

const [base, outDir] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
});
const page = await browser.newPage({ viewport: { width: 1100, height: 800 } });
const text = () => page.evaluate(() => document.body.innerText);
const out = {};

// The models, as the UI lists them from /api/tags.
await page.goto(base + "#var.vView='models'");
await page.getByText("tiny-text:latest").first().waitFor();
out.models = await text();
await page.screenshot({ path: `${outDir}/models.png` });

// A chat: the prompt goes to /api/chat (streamed); the page shows the answer under "Model:".
await page.goto(base + "#var.vView='chat'");
await page.fill("#ollama-chat-prompt", "Say hello");
await page.press("#ollama-chat-prompt", "Enter");
await page.getByText("Regenerate").waitFor({ timeout: 120000 });
out.chat = await text();
await page.screenshot({ path: `${outDir}/chat.png`, fullPage: true });

// An update of an installed model: a pull whose progress the page shows while it runs.
await page.goto(base + "#var.vView='models'");
await page.getByText("Select").first().click();
await page.getByText("Update").click();
await page.getByText("Downloading").waitFor({ timeout: 60000 });
await page.getByText(/\d+% of/).waitFor({ timeout: 60000 });
out.pulling = await text();
await page.screenshot({ path: `${outDir}/pull.png`, fullPage: true });
await page.getByText("Downloading").waitFor({ state: "detached", timeout: 120000 });
out.pulled = await text();
await browser.close();
console.log(JSON.stringify(out));
