"""Open the report's HTML in headless Chromium, follow every table-of-contents link, check that each lands on its
heading, and screenshot the top of the page and one landing (the top is committed as docs/report_top.png).

    python scripts/check_report_html.py docs/report.html docs/report_top.png /tmp/landing.png

Needs Chromium, its driver and selenium (Debian: `apt-get install chromium chromium-driver`; `pip install selenium`),
none of which the toolkit itself uses. Exits 1 if a link does not land.
"""
import sys
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.common.by import By

if len(sys.argv) != 4 or sys.argv[1] in ("-h", "--help"):
    raise SystemExit(__doc__)
page = Path(sys.argv[1]).resolve()
options = webdriver.ChromeOptions()
for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000", "--hide-scrollbars"):
    options.add_argument(flag)
driver = webdriver.Chrome(options=options)
driver.get(page.as_uri())
driver.save_screenshot(sys.argv[2])
links = driver.find_elements(By.CSS_SELECTOR, "nav a")
targets = [(a.text, a.get_attribute("href").split("#", 1)[1]) for a in links]
bad = []
for text, anchor in targets:
    driver.get(page.as_uri())
    driver.find_element(By.CSS_SELECTOR, f'nav a[href="#{anchor}"]').click()
    top = driver.execute_script(f"return document.getElementById({anchor!r}).getBoundingClientRect().top")
    scrolled = driver.execute_script("return window.scrollY")
    if not (abs(top) < 5 or scrolled > 0):
        bad.append((text, top, scrolled))
driver.get(page.as_uri() + "#" + targets[len(targets) // 2][1])
driver.save_screenshot(sys.argv[3])
driver.quit()
print(f"{len(targets)} contents links, {len(targets) - len(bad)} land on their heading")
for b in bad:
    print("  not landed:", b)
sys.exit(1 if bad else 0)
