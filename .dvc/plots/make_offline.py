"""Regenerate offline.html: the page `dvc plots show` / `dvc plots diff` write, with Vega, Vega-Lite
and vega-embed inlined so that it renders with no network (DVC's own page loads them from a CDN).

    pip install vl-convert-python && python .dvc/plots/make_offline.py

`.dvc/config` points DVC at it (`plots.html_template = plots/offline.html`). DVC fills `{plot_divs}`
with one inline `vegaEmbed('#id', spec)` script per plot; a stub queues those calls until the
bundle (a module script, so it runs after parsing) has loaded, then draws them.
"""

from __future__ import annotations

from pathlib import Path

import vl_convert as vlc

SNIPPET = """
window.vegaEmbed = vegaEmbed; window.vega = vega; window.vegaLite = vegaLite;
for (const [target, spec] of window.__dvcPlots) vegaEmbed(target, spec);
window.__dvcPlots = { push: ([target, spec]) => vegaEmbed(target, spec) };
"""

PAGE = """<!DOCTYPE html>
<!-- DVC plots, offline: Vega {vega}, Vega-Lite {vl} and vega-embed {embed} inlined by vl-convert-python.
     Made by .dvc/plots/make_offline.py; DVC uses it through .dvc/config (plots.html_template). -->
<html>
<head>
<meta charset="utf-8">
<title>DVC plots</title>
<script>
  window.__dvcPlots = [];
  window.vegaEmbed = function (target, spec) {{ window.__dvcPlots.push([target, spec]); }};
</script>
<script type="module">
{bundle}
</script>
<style>body {{ font-family: sans-serif; }} table {{ border-spacing: 15px; }}</style>
</head>
<body>
{{plot_divs}}
</body>
</html>
"""


def main() -> None:
    bundle = vlc.javascript_bundle(SNIPPET)
    assert "</script" not in bundle.lower(), "the bundle would close its own script tag"
    versions = {"vega": vlc.get_vega_version(), "vl": vlc.get_vegalite_versions()[-1]}
    page = PAGE.format(bundle=bundle, embed=vlc.get_vega_embed_version(), **versions)
    out = Path(__file__).with_name("offline.html")
    out.write_text(page, encoding="utf-8")
    print(f"wrote {out} ({len(page) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
