"""The files a coding agent reads: skills, plugin manifest, .mcp.json, AGENTS.md, docs/mcp.md."""
import asyncio
import json
import re

import pytest

from procs import ROOT

SKILLS = ROOT / ".claude" / "skills" / "gpu-training"
FIELDS = {"name", "description", "license", "compatibility", "metadata", "allowed-tools"}


@pytest.fixture(scope="module")
def tools():
    import mcp_server
    server = mcp_server.build_server(mcp_server.Gpuplane("http://127.0.0.1:1", "x"))
    return {t.name: t for t in asyncio.run(server.list_tools())}


def frontmatter(path):
    text = path.read_text()
    assert text.startswith("---\n"), path
    head = text[4:text.index("\n---\n", 4)]
    return dict(line.split(": ", 1) for line in head.splitlines())


def test_agents_md_is_mirrored_as_claude_md():
    assert (ROOT / "AGENTS.md").read_text() == (ROOT / "CLAUDE.md").read_text()


def test_skills_have_frontmatter_and_preauthorise_real_tools(tools):
    names = sorted(p.name for p in SKILLS.iterdir())
    assert names == ["analyze-results", "monitor-experiment", "run-experiment"]
    for name in names:
        fm = frontmatter(SKILLS / name / "SKILL.md")
        assert set(fm) == FIELDS, (name, fm.keys())
        assert fm["name"] == name and len(fm["description"]) > 60
        json.loads(fm["metadata"])
        allowed = fm["allowed-tools"].split()
        assert allowed and all(t.startswith("mcp__gpuplane__") for t in allowed), allowed
        unknown = {t[len("mcp__gpuplane__"):] for t in allowed} - set(tools)
        assert not unknown, (name, unknown)
        # Every tool the skill tells the agent to call is one it pre-authorises.
        body = (SKILLS / name / "SKILL.md").read_text()
        called = {t for t in re.findall(r"`([a-z_]+)`", body) if t in tools}
        assert called <= {t[len("mcp__gpuplane__"):] for t in allowed}, (name, called)


def test_plugin_manifest_and_mcp_json():
    plugin = json.loads((ROOT / ".claude-plugin" / "plugin.json").read_text())
    assert plugin["name"] == "gpuplane"
    assert plugin["mcpServers"]["gpuplane"]["command"] == "gpuplane-mcp"
    for path in plugin["skills"]:
        assert (ROOT / path / "SKILL.md").exists(), path
    mcp = json.loads((ROOT / ".mcp.json").read_text())
    assert mcp["mcpServers"]["gpuplane"]["command"] == "gpuplane-mcp"


def test_docs_list_every_tool_and_argument(tools):
    doc = (ROOT / "docs" / "mcp.md").read_text()
    for name, tool in tools.items():
        m = re.search(rf"^### `{name}`\n(.*?)(?=^#)", doc + "\n#", re.S | re.M)
        assert m, f"docs/mcp.md has no section for {name}"
        for arg in tool.input_schema.get("properties", {}):
            assert f"`{arg}`" in m.group(1), f"docs/mcp.md: {name} does not list {arg}"


def test_docs_count_the_tools_tools_list_returns(tools):
    """The counts in README.md, docs/mcp.md and the plugin come from the tool table: the totals equal
    what tools/list returns, each reference heading `## Group (N...)` has N tools under
    it, and each intro bullet `N **group** tools` agrees with its heading."""
    readme = (ROOT / "README.md").read_text()
    doc = (ROOT / "docs" / "mcp.md").read_text()
    assert re.findall(r"(\d+) MCP tools", readme) == [str(len(tools))]
    assert re.findall(r"(\d+) MCP tools", doc) == [str(len(tools))]
    plugin = json.loads((ROOT / ".claude-plugin" / "plugin.json").read_text())
    assert re.findall(r"(\d+) MCP tools", plugin["description"]) == [str(len(tools))]
    reference = doc[doc.index("# Tool reference"):]
    sections = re.split(r"^## ", reference, flags=re.M)[1:]
    counted = {}
    for section in sections:
        m = re.match(r"(\w+) \((\d+)", section)
        assert m, section[:80]
        found = re.findall(r"^### `(\w+)`", section, re.M)
        assert int(m[2]) == len(found), (m[1], m[2], found)
        counted[m[1].lower()] = len(found)
    assert sum(counted.values()) == len(tools)
    bullets = dict((k, int(n)) for n, k in re.findall(r"^- (\d+) \*\*(\w+)\*\* tools", doc,
                                                       re.M))
    assert bullets and all(counted[k if k in counted else k + "s"] == n
                           for k, n in bullets.items()), (bullets, counted)
