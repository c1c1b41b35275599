/* The course's fixes to its theme, loaded on every page of the site.
 *
 * The header's ☰ ("Toggle primary sidebar") and "Contents" buttons. pydata-sphinx-theme
 * 0.17 renders its own pair of toggles in its navbar, which sphinx-book-theme hides,
 * before sphinx-book-theme's visible pair in the article header; both themes attach their
 * handlers to `document.querySelector(".primary-toggle")` (and ".secondary-toggle"), so
 * to the hidden pair: on a phone the sidebars never open, and on a wide screen ☰ never
 * collapses the sidebar (pydata/pydata-sphinx-theme#2451, still so in 0.24). A click on a
 * visible toggle is handed to the button the handlers are on, which then does what each
 * theme means it to: open the sidebar's dialog below 992 px, collapse the sidebar above.
 *
 * The header's buttons carry Bootstrap tooltips that show on hover and on focus. A clicked
 * button kept the focus, so its tooltip stayed over the buttons beside it (the search
 * button, on a phone); sphinx-book-theme's own fix (blur on click) is bound to the hidden
 * pair too. Every header button lets the focus go when clicked, and on a touch screen,
 * where a tap counts as a hover that never ends, the header shows no tooltips.
 */
document.addEventListener("DOMContentLoaded", () => {
  for (const selector of [".primary-toggle", ".secondary-toggle"]) {
    const [bound, ...visible] = document.querySelectorAll(selector);
    for (const button of visible) {
      button.addEventListener("click", (event) => {
        event.preventDefault();
        event.stopPropagation();
        button.blur();
        bound.click();
      });
    }
  }
  const touch = window.matchMedia("(hover: none)").matches;
  for (const button of document.querySelectorAll(".bd-header-article button")) {
    const tooltip = window.bootstrap?.Tooltip.getInstance(button);
    if (touch) tooltip?.disable();
    button.addEventListener("click", () => {
      button.blur();
      tooltip?.hide();
    });
  }
});

/* Search results quote each page's text, and with it the TeX of its formulas, "\(m\)":
 * MathJax typesets the math on the pages, not in the quotes. On the search page, MathJax
 * (which ships with the site) typesets each quote as it arrives.
 */
const courseStatic = document.currentScript.src.replace(/course\.js[^/]*$/, "");
document.addEventListener("DOMContentLoaded", () => {
  const results = document.getElementById("search-results");
  if (!results) return;
  const typeset = () => {
    const quotes = [...results.querySelectorAll("p.context:not([data-typeset])")];
    if (quotes.length === 0 || !window.MathJax.typesetPromise) return;
    quotes.forEach((quote) => (quote.dataset.typeset = ""));
    window.MathJax.typesetPromise(quotes);
  };
  window.MathJax = { startup: { typeset: false } };
  const mathjax = document.createElement("script");
  mathjax.src = courseStatic + "mathjax/tex-svg.js";
  mathjax.onload = () => window.MathJax.startup.promise.then(typeset);
  document.head.appendChild(mathjax);
  new MutationObserver(typeset).observe(results, { childList: true, subtree: true });
});
