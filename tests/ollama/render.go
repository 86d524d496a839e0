// Renders Modelfile TEMPLATEs as Ollama does (template/template.go, read at commit fb30760 of
// github.com/ollama/ollama): text/template with missingkey=zero and Ollama's functions; consecutive
// messages of one role joined with a blank line first (collate); the data Ollama passes a template that
// uses .Messages. Reads {"template": ..., "chats": [[{"role", "content"}...]...]} on stdin, writes a
// JSON list of rendered prompts (or {"error": ...}) on stdout. Used by tests/test_modelfile.py.
package main

import (
	"bytes"
	"encoding/json"
	"os"
	"text/template"
	"time"
)

type message struct {
	Role       string
	Content    string
	Thinking   string
	Images     []string
	ToolCalls  []any
	ToolName   string
	ToolCallID string
}

type input struct {
	Template string `json:"template"`
	Chats    [][]struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	} `json:"chats"`
}

var funcs = template.FuncMap{
	"json": func(v any) string {
		b, _ := json.Marshal(v)
		return string(b)
	},
	"currentDate":   func(args ...string) string { return time.Now().Format("2006-01-02") },
	"yesterdayDate": func(args ...string) string { return time.Now().AddDate(0, 0, -1).Format("2006-01-02") },
}

// collate: consecutive messages of one role (tool messages aside) become one; system contents collected.
func collate(chat []message) (string, []*message) {
	var system string
	var out []*message
	for i := range chat {
		m := chat[i]
		if m.Role == "system" {
			if system != "" {
				system += "\n\n"
			}
			system += m.Content
		}
		if len(out) > 0 && out[len(out)-1].Role == m.Role && m.Role != "tool" {
			out[len(out)-1].Content += "\n\n" + m.Content
		} else {
			out = append(out, &m)
		}
	}
	return system, out
}

func fail(err error) {
	json.NewEncoder(os.Stdout).Encode(map[string]string{"error": err.Error()})
	os.Exit(0)
}

func main() {
	var in input
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		fail(err)
	}
	tmpl, err := template.New("").Option("missingkey=zero").Funcs(funcs).Parse(in.Template)
	if err != nil {
		fail(err)
	}
	rendered := []string{}
	for _, c := range in.Chats {
		chat := make([]message, len(c))
		for i, m := range c {
			chat[i] = message{Role: m.Role, Content: m.Content}
		}
		system, msgs := collate(chat)
		var b bytes.Buffer
		data := map[string]any{"System": system, "Messages": msgs, "Tools": nil, "Response": "",
			"Think": false, "ThinkLevel": "", "IsThinkSet": false}
		if err := tmpl.Execute(&b, data); err != nil {
			fail(err)
		}
		rendered = append(rendered, b.String())
	}
	json.NewEncoder(os.Stdout).Encode(rendered)
}
